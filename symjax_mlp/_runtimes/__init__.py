"""Stage 4 of the flow: the runtimes that run a loaded artifact (``jax``, ``iree``).

A runtime module has, called by :func:`~symjax_mlp.load`: ``check_supported(path, manifest)``,
raising :class:`~symjax_mlp.ArtifactError` for an artifact it cannot run here; optionally
``check_program(path, report)``, refusing ops it cannot run; and ``runner(path, manifest,
blobs, params, *, exported, guard, custom_calls) -> (run, weights)``, where ``run(inputs)``
returns the outputs and ``guard`` (``None`` when trusted) checks each module before it compiles.
"""
