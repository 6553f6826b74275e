"""Classification data for :func:`~symjax_mlp.training.train`: a fixed split, checked first
(:func:`check_dataset` names every problem of a :class:`Dataset` before a step runs)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from symjax_mlp._errors import ConfigError, DataError, as_int
from symjax_mlp.training._state import is_count


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A fixed train/test split: features ``(n, d)`` float32, labels ``(n,)`` int32.

    Attributes:
      x_train, y_train: the examples the optimizer sees.
      x_test, y_test: held out; accuracy is reported on these.
      num_classes: how many classes the labels index (``None``: ``max(label) + 1``).
      name: shown in messages and the training history.
      mean, std: the per-feature statistics the features were standardised with, or ``None``.

    Example:
      >>> import numpy as np
      >>> from symjax_mlp.training import Dataset
      >>> x = np.zeros((4, 3), np.float32); y = np.array([0, 1, 0, 1])
      >>> Dataset(x, y, x, y).num_features
      3
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int | None = None
    name: str = "dataset"
    mean: np.ndarray | None = None
    std: np.ndarray | None = None

    @property
    def num_features(self) -> int:
        """The width of a feature row (the model's input width)."""
        return int(np.shape(self.x_train)[-1])

    def standardize(self, x: np.ndarray) -> np.ndarray:
        """Applies this dataset's standardisation to raw features ``x`` (float32)."""
        x = np.asarray(x, np.float32)
        if self.mean is None or self.std is None:
            return x
        if x.shape[-1:] != (width := (np.size(self.mean),)):  # was NumPy's broadcast error
            raise DataError(
                f"{self.name}.standardize(x): x has shape {x.shape}, but the statistics are of "
                f"{width[0]} features. Pass rows of {width[0]} raw features, shape (n, {width[0]})."
            )
        return ((x - self.mean) / self.std).astype(np.float32)


def load_digits(*, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's bundled handwritten digits: 1797 8x8 images, 10 classes, a fixed split.

    The split is stratified and depends only on ``seed``; features are standardised with the
    training split's per-pixel mean and standard deviation (constant pixels get std 1).

    Args:
      test_fraction: share of each class held out for testing, in (0, 1).
      seed: seeds the split (not the training).

    Raises:
      ImportError: scikit-learn is missing; install the extra: ``pip install symjax_mlp[data]``.
      ConfigError: ``test_fraction`` is not a number in (0, 1), or ``seed`` not an int >= 0.

    Example:
      >>> data = load_digits()
      >>> data.x_train.shape, data.x_test.shape, data.num_classes
      ((1438, 64), (359, 64), 10)
    """
    given = f"symjax_mlp.training.load_digits(test_fraction={test_fraction!r}, seed={seed!r})"
    seed, real = as_int(seed), isinstance(test_fraction, numbers.Real)
    if not (real and not isinstance(test_fraction, bool) and 0.0 < test_fraction < 1.0):
        raise ConfigError(
            f"{given}: test_fraction must be a number in (0, 1), the share of each class held "
            "out; pass e.g. test_fraction=0.2."
        )
    if not is_count(seed):  # NumPy's raw TypeError or ValueError ('non-negative') otherwise
        raise ConfigError(f"{given}: seed must be an int >= 0; pass e.g. seed=0.")
    try:
        from sklearn.datasets import load_digits as _sklearn_digits
    except ImportError as e:
        raise ImportError(
            "load_digits needs scikit-learn, which ships the digits data: "
            "pip install 'symjax_mlp[data]'.",
            name="sklearn",
        ) from e
    x, y = _sklearn_digits(return_X_y=True)
    x, y = x.astype(np.float32), y.astype(np.int32)
    rng = np.random.default_rng(seed)
    test_rows = []
    for c in np.unique(y):  # stratified: the same share of every class is held out
        rows = rng.permutation(np.flatnonzero(y == c))
        test_rows.append(rows[: round(len(rows) * test_fraction)])
    is_test = np.zeros(len(y), bool)
    is_test[np.concatenate(test_rows)] = True
    mean, std = x[~is_test].mean(axis=0), x[~is_test].std(axis=0)
    std = np.where(std > 0, std, np.float32(1)).astype(np.float32)
    x_train, x_test = (x[~is_test] - mean) / std, (x[is_test] - mean) / std
    return Dataset(x_train, y[~is_test], x_test, y[is_test], 10, "digits", mean=mean, std=std)


_NOT_ROWS = (
    "{caller}: {name} has shape {shape}: examples of shape {example}, but train() fits rows of "
    "features, (examples, features). For a model of rows, reshape them: x.reshape(len(x), -1). "
    "For one that takes them as they are (a CNN's images), run its steps with the pieces: "
    "params = sm.training.init_params(model, key, x[:1]); step = jax.jit("
    "sm.training.train_step(model, optimizer)); params, opt_state, metrics = step(params, "
    "opt_state, x, y, w), with opt_state = optimizer.init(params) (of params.params for a "
    "model with state)."
)


_CALLER = "symjax_mlp.training.train"  # the call whose data these functions check
_MAX_SPARSE_CLASSES = 2**16  # more outputs than this, most never a label: IDs, not classes
_ID_LABELS = (
    "symjax_mlp.training.train: the labels go up to {largest} but take only {distinct} distinct "
    "values: they look like IDs, not class indices. The default model would have {classes} "
    "outputs, a class per index, a layer that may not fit in memory: train() refuses "
    "over {limit} classes when most of them never occur. Remap the labels of both splits to "
    "0..K-1: _, y = np.unique(np.concatenate([y_train, y_test]), return_inverse=True), then "
    "split y; or pass a model."
)


def check_dataset(data: Dataset) -> Dataset:
    """``data`` as float32 features and int32 labels, checked (once: the labels against the
    model's outputs, once it is known, by :func:`check_outputs`)."""
    if not isinstance(data, Dataset):
        fields = {f.name for f in dataclasses.fields(Dataset)}
        got, wrap = f"a {type(data).__name__}", "(x_train, y_train, x_test, y_test)"
        if isinstance(data, Mapping):
            got += f" of keys {sorted(map(str, data))[:8]}"
            wrap = "(**data)" if data and set(data) <= fields else wrap
        elif isinstance(data, tuple | list) and 4 <= len(data) <= len(fields):
            got, wrap = f"{got} of {len(data)} items", "(*data)"
        raise ConfigError(
            f"{_CALLER}: data must be a symjax_mlp.training.Dataset; got {got}. "
            f"Wrap the arrays: sm.training.Dataset{wrap}."
        )
    xs = {name: _features(data, name) for name in ("x_train", "x_test")}
    width, test_width = xs["x_train"].shape[1], xs["x_test"].shape[1]
    if test_width != width:
        raise DataError(
            f"{_CALLER}: {data.name}.x_test has {test_width} features per example but x_train has "
            f"{width}; both splits must have the same feature width. Preprocess them the same way."
        )
    stats = _statistics(data, width)
    ys = _labels(data, len(xs["x_train"]), len(xs["x_test"]))
    name = data.name if isinstance(data.name, str | int | None) else str(data.name)  # JSON
    return dataclasses.replace(data, **xs, **ys, **stats, name=name)


def _features(data: Dataset, name: str) -> np.ndarray:
    """``data.<name>`` as float32 rows of features, checked."""
    where, x = f"{data.name}.{name}", _array(data, name)
    if x.ndim > 2:
        raise DataError(
            _NOT_ROWS.format(caller=_CALLER, name=where, shape=x.shape, example=x.shape[1:])
        )
    if x.ndim != 2:
        raise DataError(
            f"{_CALLER}: {where} has shape {x.shape}; expected 2-D features (examples, "
            "features). Reshape it, e.g. x.reshape(len(x), -1)."
        )
    if 0 in x.shape:  # no feature: an initialiser's fan-in of 0, ZeroDivisionError
        what = "example" if x.shape[0] == 0 else "feature per example"
        raise DataError(
            f"{_CALLER}: {where} is empty (shape {x.shape}); expected at least one {what}. "
            "Check the loading and splitting of the data."
        )
    if not (np.issubdtype(x.dtype, np.integer) or jnp.issubdtype(x.dtype, jnp.floating)):
        raise DataError(
            f"{_CALLER}: {where} has dtype {x.dtype}; expected real numbers. Pass numeric "
            "features, e.g. x.astype(np.float32) (parsed first, if they are text)."
        )
    _check_finite(where, x)
    with np.errstate(over="ignore"):
        x32 = x.astype(np.float32)
    if not np.isfinite(x32).all():  # finite in float64, past float32's range
        raise DataError(
            f"{_CALLER}: {where} holds values up to {np.abs(x).max():g} in magnitude, past "
            "float32's range; train() computes in float32. Rescale the features, e.g. "
            "standardise them."
        )
    return x32


def _statistics(data: Dataset, width: int) -> dict[str, np.ndarray]:
    """``data``'s ``mean`` and ``std`` (both or neither), checked, as float32."""
    stats = {k: getattr(data, k) for k in ("mean", "std") if getattr(data, k) is not None}
    for k, v in stats.items():  # the exported model computes (x - mean) / std with them
        a = np.asarray(v, np.float32) if np.issubdtype(np.asarray(v).dtype, np.number) else None
        bad = a is None or a.size != width or not np.isfinite(a).all()
        if bad or (k == "std" and a.min() <= 0):
            got = f"{np.shape(v)} values {str(v)[:80]}" if a is not None else repr(v)[:80]
            raise DataError(
                f"{_CALLER}: {data.name}.{k} is {got}; expected the {width} per-feature finite "
                "values the features were standardised with (std > 0), or None. Pass "
                "x.mean(axis=0) and x.std(axis=0) with constant features' std set to 1."
            )
        stats[k] = a.reshape(width)
    if len(stats) == 1:
        raise DataError(
            f"{_CALLER}: {data.name} has a {next(iter(stats))} but no "
            f"{({'mean', 'std'} - set(stats)).pop()}; expected both (the features were "
            "standardised with them) or neither."
        )
    return stats


def _labels(data: Dataset, *rows: int) -> dict[str, np.ndarray]:
    """``data``'s labels as int32 class indices, one per row of its splits' features, checked."""
    classes = data.num_classes
    count = isinstance(classes, numbers.Integral) and not isinstance(classes, bool)
    if classes is not None and not (count and classes >= 1):
        raise DataError(
            f"{_CALLER}: {data.name}.num_classes is {classes!r}; expected an int >= 1, the number "
            "of classes the labels index (or None: the largest label + 1)."
        )
    limit, what = 2**31 - 1, "labels are int32 class indices"  # checked before the cast
    if classes is not None and classes < limit:
        limit, what = classes, f"{data.name}.num_classes is {classes}"
    ys = {}
    for name, n in zip(("y_train", "y_test"), rows, strict=True):
        where, y = f"{data.name}.{name}", _array(data, name)
        if y.ndim != 1 or len(y) != n:
            raise DataError(
                f"{_CALLER}: {where} has shape {y.shape}; expected one integer label per row of "
                f"x{name[1:]}, shape ({n},). Pass the class indices: y.argmax(axis=1) of "
                "one-hot rows, y.reshape(-1) of a column."
            )
        if not np.issubdtype(y.dtype, np.integer):
            if not jnp.issubdtype(y.dtype, jnp.floating):
                raise DataError(
                    f"{_CALLER}: {where} has dtype {y.dtype}; expected int labels, the class "
                    "indices. Pass y.astype(np.int32) (bools: 0 and 1; text: np.unique(y, "
                    "return_inverse=True)[1])."
                )
            _check_finite(where, y)
            y = y.astype(np.float64)  # float16's range ends before int32's: compared in float64
            if np.any(y != np.round(y)):
                bad = int(np.flatnonzero(y != np.round(y))[0])
                raise DataError(
                    f"{_CALLER}: {where}[{bad}] is {float(y[bad])!r}; expected integer class "
                    "labels, the class indices. Map the values to them: np.unique(y, "
                    "return_inverse=True)[1] (a regression target needs a loop of your own)."
                )
        _in_range(where, name, y, limit, what)
        ys[name] = y.astype(np.int32)
    return ys


def check_outputs(data: Dataset, num_outputs: int) -> None:
    """Refuses labels of ``data`` (checked by :func:`check_dataset`) past the model's outputs,
    then a ``num_classes`` past them (classes the model could never predict)."""
    for name in ("y_train", "y_test"):
        what = f"the model has {num_outputs} outputs"
        _in_range(f"{data.name}.{name}", name, getattr(data, name), num_outputs, what)
    if (classes := data.num_classes) is not None and classes > num_outputs:
        raise DataError(
            f"{_CALLER}: {data.name}.num_classes is {classes}, but the model has {num_outputs} "
            f"outputs, one logit per class: it could never predict the classes past "
            f"{num_outputs - 1}. Give the model {classes} outputs, or pass the number of "
            f"classes it has, num_classes={num_outputs} (None: the largest label + 1)."
        )


def _in_range(where: str, name: str, y: np.ndarray, limit: int, what: str) -> None:
    """Refuses labels ``y`` outside ``0 .. limit - 1`` (``what`` says why that is the limit)."""
    out = np.flatnonzero((y < 0) | (y >= limit))
    if out.size:
        raise DataError(
            f"{_CALLER}: labels out of range: {where} holds values from {y.min():g} to "
            f"{y.max():g} ({out.size} out of range, first {name}[{out[0]}] = "
            f"{y[out[0]]:g}), but {what}, so labels must be integers in 0..{limit - 1}. "
            "Remap the labels to 0..K-1 or give the model K outputs."
        )


def default_classes(data: Dataset) -> int:
    """The default model's outputs: ``num_classes``, else the largest label + 1; refuses labels
    like IDs (a layer that wide) and one class (unless ``num_classes`` >= 2 says more exist)."""
    present = np.unique(data.y_train)
    if len(present) == 1 and (data.num_classes or 0) < 2:  # the classes are the labels'
        raise DataError(
            f"{_CALLER}: {data.name}.y_train holds one class, {present[0]}, in all its "
            f"{len(data.y_train)} labels: trained on it, a classifier learns nothing (its loss "
            "goes to 0, its accuracy to 100%). A classifier needs at least two classes: add "
            "examples of another, or pass num_classes >= 2 if the others exist but this split has "
            "none."
        )
    largest = int(max(data.y_train.max(), data.y_test.max()))
    classes = data.num_classes or largest + 1
    distinct = len(np.unique(np.concatenate([data.y_train, data.y_test])))
    if classes > _MAX_SPARSE_CLASSES and classes > 2 * distinct:
        raise DataError(
            _ID_LABELS.format(
                largest=largest, distinct=distinct, classes=classes, limit=_MAX_SPARSE_CLASSES
            )
        )
    return classes


def _array(data: Dataset, name: str) -> np.ndarray:
    """``data.<name>`` as a NumPy array; a ragged list or a generator is a DataError."""
    value, error = getattr(data, name), None
    try:
        a = np.asarray(value)
        why = f"a {type(value).__name__}"  # a generator, None: a 0-d array of an object
    except (ValueError, TypeError) as e:
        a, why = None, str(e)[:160]
    except Exception as e:  # the value's own reader failed (its __array__, __getitem__)
        a, why, error = None, f"{type(e).__name__}: {str(e)[:160]}", e
    if a is not None and (a.ndim or a.dtype != object):
        sized = a.ndim and hasattr(value, "__len__") and not isinstance(value, np.ndarray)
        if sized and (n := len(value)) != len(a):  # a sequence whose rows stopped early
            raise DataError(
                f"{_CALLER}: {data.name}.{name} has {n} rows (its len) but gave {len(a)} when "
                "read: its reading stopped early. Pass every row, e.g. np.asarray of the "
                "complete rows."
            )
        return a
    raise DataError(
        f"{_CALLER}: {data.name}.{name} is not an array of numbers ({why}); expected rows of equal "
        "length. Pass np.asarray(rows), ragged rows padded or dropped (a generator's: list(rows))."
    ) from error


def _check_finite(name: str, a: np.ndarray) -> None:
    bad = ~np.isfinite(a)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        kind = "NaN" if np.isnan(a[first]) else "infinite"
        where = ", ".join(map(str, first))
        raise DataError(
            f"{_CALLER}: {name} contains {int(bad.sum())} non-finite values (first: "
            f"{name}[{where}] is {kind}); expected finite numbers. Drop or impute those examples "
            "before training."
        )
