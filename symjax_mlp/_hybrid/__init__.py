"""Stage 1 of the flow: arguments -> trace log -> mesh -> jaxpr reading -> DOT -> Graph -> pure
models -> held state -> traced model -> Hybrid -> hybridize."""
