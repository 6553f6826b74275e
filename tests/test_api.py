"""The public surface: names are a contract, errors form one hierarchy."""

import importlib
import inspect

import pytest

import symjax_mlp as sm

PUBLIC = {
    "symjax_mlp": {
        # models
        "ACTIVATIONS", "Dense", "HybridConcurrent", "HybridSequential", "mlp",
        # hybrid, tracing, sharding, graph
        "Hybrid", "TraceEvent", "hybridize", "shard", "data_mesh", "Graph", "stage",
        # artifacts
        "Artifact", "LoadedModel", "Signature", "TensorSpec", "VerifyCheck", "VerifyReport",
        "export", "inspect", "load", "verify", "sign", "verify_signature",
        # timing a model against its AOT-compiled floor
        "CallTiming", "timeit",
        # errors
        "ArtifactError", "CheckpointError", "ConfigError", "ControlFlowError", "DataError",
        "DivergenceError", "RetraceError", "SignatureError", "SymjaxError",
        # warnings
        "RetraceWarning",
        # public sub-packages
        "chapter", "serving", "training",
    },
    "symjax_mlp.training": {
        "Dataset", "EpochRecord", "ShardedStep", "Step", "TrainResult", "TrainState",
        "init_params", "latest_checkpoint", "load_digits", "restore_checkpoint",
        "save_checkpoint", "shard_step", "train", "train_step",
        # multi-process runs
        "DistributedError", "EXIT_STATUS", "initialize",
    },
    "symjax_mlp.serving": {
        "LATENCY_BUCKETS", "AsyncRequest", "Batcher", "BatcherStats", "OverloadError",
        "RequestFuture", "RequestTiming", "create_app", "dispatch_mode", "latency_mode", "ray_app",
        "serve",
    },
    "symjax_mlp.chapter": {
        "HybridNet", "chapter_mlp", "describe_mlp", "export_mlp", "fancy_func", "tour",
    },
}  # fmt: skip


@pytest.mark.parametrize("namespace", sorted(PUBLIC))
def test_all_is_pinned(namespace):
    module = importlib.import_module(namespace)
    assert set(module.__all__) == PUBLIC[namespace]
    assert len(set(module.__all__)) == len(module.__all__)  # no duplicates
    for name in module.__all__:
        assert hasattr(module, name), name


def test_the_top_level_is_the_core():
    # about 30 names: training and serving live below, in public sub-packages, whose names
    # alone are at the top; the benchmark is no part of the package (scripts/bench.py)
    subpackages = {n for n in sm.__all__ if f"symjax_mlp.{n}" in PUBLIC}
    assert subpackages == {"chapter", "serving", "training"}
    # 31, signing (sign, verify_signature), timing a model (timeit, CallTiming), RetraceWarning
    assert len(set(sm.__all__) - subpackages) <= 36


def test_public_names_never_shadow_their_modules():
    for namespace in PUBLIC:
        module = importlib.import_module(namespace)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                assert obj.__name__ == f"{namespace}.{name}", name


def test_errors_form_one_hierarchy():
    errors = [getattr(sm, n) for n in sm.__all__ if n.endswith("Error")]
    assert all(issubclass(e, sm.SymjaxError) for e in errors)
    assert {e.__module__ for e in errors} == {"symjax_mlp._errors"}


def test_an_unwritable_output_is_a_config_error_and_none_is_raised_as_the_base_class(tmp_path):
    """'cannot write DIR' was a bare SymjaxError, which no except clause but the base caught."""
    from pathlib import Path

    from symjax_mlp._files import write_output

    with pytest.raises(sm.ConfigError, match=r"cannot write .* Pass another path\.$"):
        write_output((tmp_path, b"{}"))
    package = Path(sm.__file__).parent
    bare = [f.name for f in package.rglob("*.py") if "raise SymjaxError(" in f.read_text()]
    assert bare == []


@pytest.mark.parametrize("namespace", sorted(PUBLIC))
def test_public_callables_are_documented_and_typed(namespace):
    module = importlib.import_module(namespace)
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj):
            assert obj.__doc__, f"{name} has no docstring"
            sig = inspect.signature(obj)
            assert sig.return_annotation is not inspect.Signature.empty, name


def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    assert sm.__version__ == version("symjax_mlp")


def test_what_one_module_uses_of_anothers_objects_is_public_and_documented():
    # (tests/test_layout.py refuses a reach into another object's privates)
    from symjax_mlp.serving import AsyncRequest, RequestFuture

    for used in (sm.Hybrid.fn_with_state, sm.Hybrid.moved_state, sm.LoadedModel.runner):
        assert used.__doc__, used
    assert "kind:" in sm.Hybrid.__doc__
    assert all("batch_record" in kind.__doc__ for kind in (AsyncRequest, RequestFuture))
