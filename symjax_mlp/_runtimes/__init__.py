"""Stage 4 of the flow: the runtimes that run a loaded artifact.

A runtime is a module with these functions, called by :func:`~symjax_mlp.load`:

- ``check_supported(path, manifest)`` raises :class:`~symjax_mlp.ArtifactError` for an
  artifact this runtime cannot run here (platform, device count, effects);
- ``check_program(path, report)`` (optional) refuses a program whose ops it cannot run,
  from the :class:`~symjax_mlp._artifact.ops.ModuleReport` of the module that runs;
- ``runner(path, manifest, blobs, params, *, exported, guard) -> (run, weights)`` returns
  ``run(inputs) -> [array, ...]`` and the weights it runs with; ``guard`` (``None`` when
  trusted) checks each call's refined module before it compiles.
"""
