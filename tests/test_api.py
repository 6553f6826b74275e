"""The public surface: names are a contract, errors form one hierarchy."""

import inspect

import symjax_mlp as sm

PUBLIC = {
    # models
    "ACTIVATIONS", "Dense", "HybridConcurrent", "HybridSequential", "mlp",
    # hybrid + tracing
    "ArgSpec", "Hybrid", "TraceEvent", "hybridize",
    # graph
    "Graph", "stage",
    # artifacts
    "Artifact", "LoadedModel", "Signature", "TensorSpec", "VerifyCheck", "VerifyReport",
    "export", "export_mlp", "inspect", "load", "verify",
    # training
    "Dataset", "EpochRecord", "TrainResult", "TrainState", "latest_checkpoint", "load_digits",
    "restore_checkpoint", "save_checkpoint", "time_train_step", "train", "train_step",
    # distributed
    "LoadedSharded", "Sharded", "ShardedStep", "bench_devices", "data_mesh", "load_sharded",
    "shard", "shard_step",
    # errors
    "ArtifactError", "ControlFlowError", "DataError", "DivergenceError", "RetraceError",
    "SignatureError", "SymjaxError",
}  # fmt: skip


def test_all_is_pinned():
    assert set(sm.__all__) == PUBLIC
    assert len(set(sm.__all__)) == len(sm.__all__)  # no duplicates
    for name in sm.__all__:
        assert hasattr(sm, name), name


def test_errors_form_one_hierarchy():
    errors = [getattr(sm, n) for n in sm.__all__ if n.endswith("Error")]
    assert all(issubclass(e, sm.SymjaxError) for e in errors)
    assert {e.__module__ for e in errors} == {"symjax_mlp.errors"}


def test_public_callables_are_documented_and_typed():
    for name in sm.__all__:
        obj = getattr(sm, name)
        if inspect.isfunction(obj):
            assert obj.__doc__, f"{name} has no docstring"
            sig = inspect.signature(obj)
            assert sig.return_annotation is not inspect.Signature.empty, name


def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    assert sm.__version__ == version("symjax_mlp")
