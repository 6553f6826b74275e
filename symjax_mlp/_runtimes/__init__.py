"""Stage 4 of the flow: the runtimes that run a loaded artifact.

A runtime is a module with two functions, called by :func:`~symjax_mlp.load` after every
check of the artifact has passed:

- ``check_supported(path, manifest)`` raises :class:`~symjax_mlp.ArtifactError` for an
  artifact this runtime cannot run here (platform, device count, ops);
- ``runner(path, manifest, blobs, params) -> run`` returns ``run(inputs) -> [array, ...]``.

``jax`` runs the ``jax.export`` module through XLA; ``iree`` compiles ``model.mlirbc`` with
IREE (no JAX on the call path).
"""
