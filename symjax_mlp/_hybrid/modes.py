"""An nnx module's modes in a Hybrid: the settings ``module.train()`` and ``eval()`` flip.

An nnx module carries its mode in its submodules' attributes (``deterministic``,
``use_running_average``, other bools), and the user flips them after ``hybridize``. A Hybrid
reads them at every call and keys its traces on them (:meth:`ModuleModes.key`): so
``module.eval()`` retraces once, its reason naming what changed, and every later call in that
mode reuses its program. A trace runs with the settings it was keyed on
(:func:`settings_in`), whatever the module says meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable

from symjax_mlp._hybrid.args import ModuleSetting, settings_key
from symjax_mlp._hybrid.pure import PureModel, mode_settings


class ModuleModes:
    """The settings of a Hybrid's nnx module, read when it is called.

    Attributes:
      model: the module as a :class:`~symjax_mlp._hybrid.pure.PureModel`.
      now: returns the settings as they are now, in the order of ``model.setting_names``.
    """

    def __init__(self, model: PureModel, now: Callable[[], tuple] | None = None) -> None:
        self.model = model
        self.now = model.settings if now is None else now
        self._names = tuple(map(ModuleSetting, model.setting_names))
        self._keyed: dict[tuple, tuple] = {}  # settings -> their static entries, once per mode

    @classmethod
    def of(cls, model: PureModel) -> ModuleModes | None:
        """The modes of ``model``; ``None`` when it has none (not an nnx module, or one
        without settings)."""
        return None if model.settings is None else cls(model)

    def fixed(self) -> ModuleModes:
        """These modes, fixed as they are now: ``module.train()`` later does not switch them."""
        values = self.now()
        return ModuleModes(self.model, lambda: values)

    def key(self, static: tuple) -> tuple:
        """``static`` and the settings as they are now, the entries a trace is keyed on."""
        values = self.now()
        entries = self._keyed.get(values)
        if entries is None:
            entries = self._keyed[values] = settings_key(self._names, values)
        return static + entries

    def training(self, program: Callable[[tuple], str]) -> tuple[str, ...]:
        """The settings that hold the module in training mode, as ``"path=value"``, where
        flipping them changes ``program(settings)`` (the staged program's text); ``()`` in
        eval mode."""
        now = self.now()
        evaluating = mode_settings(self.model, now, train=False)
        if now == evaluating or program(now) == program(evaluating):
            return ()
        pairs = zip(self.model.setting_names, now, evaluating, strict=True)
        return tuple(f"{n}={v}" for n, v, e in pairs if v != e)


def settings_in(static: tuple) -> tuple:
    """The module settings a static key holds (``()``: none)."""
    return tuple(v for k, v, _ in static if type(k) is ModuleSetting)
