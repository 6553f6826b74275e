"""Stage 1 of the flow: trace log -> mesh -> jaxpr reading -> DOT -> Graph -> rng -> pure models
-> settings -> Hybrid -> hybridize."""
