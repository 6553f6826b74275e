"""Stage 1 of the flow: trace log -> mesh -> jaxpr reading -> DOT -> Graph -> Hybrid."""
