"""Models an engine loads from the same checkpoint as its main model, updated with it.

An engine running speculative decoding with multi-token-prediction heads (vLLM's
`--speculative-config '{"method": "mtp"}'`: DeepSeek-V3's, MiMo's, GLM-4.5's, Qwen3-Next's
MTP layers) builds its drafter as a second model from the SAME checkpoint: the drafter's
loader takes the checkpoint's extra layers (`model.mtp_layers.*`,
`model.layers.{num_hidden_layers}.*`), which the main model's loader skips. An update
applied only to the main model would leave the MTP head at its old version, while the
engine reports the new one: acceptance drops for an untrained head, and for heads trained
with the policy the drafts stop being the policy's.

So a push to such an engine is applied to both models, checked and verified by each
model's own loader (nothing here knows a model family):

- `CompanionExpectations`: an update must satisfy the main model's loader and every
  companion's. An update that leaves out tensors the drafter loads (its MTP layers) is
  refused before any byte moves, naming them, exactly as a main-model layer left out is.
- `CompanionTarget`: streams the update into the main model; the tensors a companion's
  loader takes (its dry run on the engine's own checkpoint says which) are copied to the
  host on the way, then applied to the companion with its own target (its loader, its
  repairs, its verification against a fresh load of the companion). A failure in either
  fails the update (the worker reports it torn).

A separately trained draft model (vLLM's "draft_model" method) is not a companion: it has
its own checkpoint and is pushed on its own (vLLM's `start_draft_weight_update`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from enginehooks.core.manifest import Manifest, TensorSpec
from enginehooks.engine.apply import ApplyBinding, ApplyTarget
from enginehooks.engine.expectations import Expectations
from enginehooks.transports.base import Target

__all__ = ["CompanionBinding", "CompanionExpectations", "CompanionTarget"]


class CompanionExpectations(Expectations):
    """The main model's expectations plus each companion's: an update is taken only when
    every model that loads from the checkpoint would take it. Everything else (digests,
    plans, kept modules) is the main model's."""

    def __init__(self, main: Expectations, companions: Sequence[tuple[str, Expectations]]
                 ) -> None:
        self.main = main
        self.companions = list(companions)

    def problems(self, specs: Sequence[TensorSpec], keep: Sequence[str] = ()) -> list[str]:
        def ask(e: Expectations) -> list[str]:
            # an `Expectations` written before `keep` existed still answers full updates
            return e.problems(specs, keep=keep) if keep else e.problems(specs)

        out = ask(self.main)
        for label, e in self.companions:
            out += [f"{label}: {p}" for p in ask(e)]
        return out

    def checkpoint_spec(self, name: str) -> TensorSpec | None:
        spec = self.main.checkpoint_spec(name)
        for _, e in self.companions:
            if spec is not None:
                break
            spec = e.checkpoint_spec(name)
        return spec

    def wire_dtypes(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for _, e in reversed(self.companions):
            out.update(e.wire_dtypes())
        out.update(self.main.wire_dtypes())
        return out

    def uncast(self) -> list[str]:
        names = set(self.main.uncast())
        for _, e in self.companions:
            names.update(e.uncast())
        return sorted(names)

    def unloaded(self) -> list[str]:
        return self.main.unloaded()

    def __getattr__(self, name: str) -> Any:
        # `kept`, `landings`, `record_plan`, ...: the main model's
        return getattr(self.main, name)


class CompanionTarget(Target):
    """Applies an update to the main model's target, then to each companion's, with the
    tensors each companion's loader takes (see the module docstring). Attributes it does
    not define (`verifier`, `plan`, ...) are the main target's."""

    def __init__(self, main: ApplyTarget, companions: Sequence[tuple[str, ApplyTarget]]) -> None:
        self.main = main
        self.companions = list(companions)
        self.device: torch.device = main.device
        #: per companion, the checkpoint names its loader writes somewhere
        self._takes: list[set[str]] | None = None
        #: what the last update gave each companion (tensor count), for the reply
        self.last: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.main, name)

    def takes(self) -> list[set[str]]:
        """Per companion, the checkpoint tensors its own loader lands (its dry run on the
        checkpoint the engine started from): the ones the update must hand it."""
        if self._takes is None:
            self._takes = [{n for n, landing in c.expectations().baseline().items()
                            if landing.params} for _, c in self.companions]
        return self._takes

    def prepare(self, manifest: Manifest) -> None:
        self.main.prepare(manifest)
        takes = self.takes()
        for (_, c), names in zip(self.companions, takes, strict=True):
            # its share of the manifest (`prepare` reads the specs and the requests)
            c.prepare(dataclasses.replace(
                manifest, tensors=tuple(t for t in manifest.tensors if t.name in names)))

    def apply(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        takes = self.takes()
        wanted = set().union(*takes)
        copies: list[tuple[str, torch.Tensor]] = []

        def tee() -> Iterator[tuple[str, torch.Tensor]]:
            # the transport reuses its buffers: keep host copies of what companions take
            for name, t in tensors:
                if name in wanted:
                    copies.append((name, t.to("cpu", copy=True)))
                yield name, t

        stream = tee()
        self.main.apply(stream)
        for _ in stream:  # a loader that stopped early still hands companions all of theirs
            pass
        self.last = {}
        for (label, c), names in zip(self.companions, takes, strict=True):
            mine = [(n, t) for n, t in copies if n in names]
            c.apply(iter(mine))
            self.last[label] = len(mine)

    def destination(self, name: str) -> torch.Tensor | None:
        return self.main.destination(name)

    def load_path(self, path: str) -> bool:
        if not self.main.load_path(path):
            return False
        return all(c.load_path(path) for _, c in self.companions)


class CompanionBinding(ApplyBinding):
    """An `ApplyBinding` whose updates also go to companion models (none: exactly an
    `ApplyBinding`): its target is a `CompanionTarget`, its expectations a
    `CompanionExpectations`, and `info` and the receive reply say, per companion, what
    it took and how it was verified. An engine subclass adds what `ApplyBinding`'s add."""

    def __init__(self, target: ApplyTarget, companions: Sequence[tuple[str, ApplyTarget]] = (),
                 worker_rank: int = 0, beacon: str | None = None) -> None:
        super().__init__(target, worker_rank, beacon)
        self._both = CompanionTarget(target, companions) if companions else None
        self._both_expectations: CompanionExpectations | None = None

    def target(self) -> Any:
        return self._both if self._both is not None else self._target

    def expectations(self) -> Expectations:
        if self._both is None:
            return self._target.expectations()
        if self._both_expectations is None:
            self._both_expectations = CompanionExpectations(
                self._target.expectations(),
                [(label, c.expectations()) for label, c in self._both.companions])
        return self._both_expectations

    def after_update(self, version: int | str) -> dict[str, Any]:
        if self._both is None:
            return {}
        return {"companions": {
            label: {"tensors": self._both.last.get(label),
                    **({"verification": dict(c.verifier.last)} if c.verifier.last else {})}
            for label, c in self._both.companions}}

    def info(self) -> dict[str, Any]:
        out = super().info()
        if self._both is not None:
            out["companions"] = {label: {"verification": c.verifier.state(),
                                         "tensors_last": self._both.last.get(label)}
                                 for label, c in self._both.companions}
        return out
