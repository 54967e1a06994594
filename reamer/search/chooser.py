"""The layout chooser: what the agent asks for the layout of an online job deployed without one.

The agent asks every chooser the same way: `chooser(request)` with one LayoutRequest (the job's model and
backend, the free cpus it may use, its SLO, rate, largest batch, traffic and precision), and it answers a
LayoutChoice, or None for no opinion (then the job runs as one instance over all the free cpus). The built-in
one, ProfileCacheChooser, plans from the cached profile and, when the agent searches on deploy
(SearchOnDeploy), measures on the free cpus what the cache lacks (reamer.search.on_cores). Another one is
named in the agent's config as inference.layout_chooser = "module:attribute": any callable that takes the one
request, a function or an object with `__call__` (the LayoutChooser protocol). New facts about a job become
new fields of LayoutRequest, so a chooser written today keeps working.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from reamer.host.errors import ReamerError
from reamer.search.backends import AUTO, installed_backends

if TYPE_CHECKING:
    from reamer.serve.samples import SampleSpec

log = logging.getLogger("reamer.inference")


@dataclass
class LayoutChoice:
    """What a layout chooser decided for an online job on the given cores."""

    layout: str | None  # None: no opinion (the default: one instance over all free cores)
    accepted: bool = True
    achievable_rps: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class LayoutRequest:
    """What a layout chooser is asked: a layout for `model` on `backend` ("auto": the chosen layout names the
    backend) over `cpus`, serving `rate_rps` (None: not given) within `slo_ms` (None: no SLO), batches of at
    most `max_batch` (None: the chooser's own limit), the job's traffic (`samples`: shapes and sample data;
    None: the model's own shapes) at `precision`."""

    model: str
    backend: str
    cpus: list[int]
    slo_ms: float | None = None
    rate_rps: float | None = None
    max_batch: int | None = None
    samples: "SampleSpec | None" = None
    precision: str = "f32"


@runtime_checkable
class LayoutChooser(Protocol):
    """The one way the agent asks for a layout (config inference.layout_chooser names one)."""

    def __call__(self, request: LayoutRequest) -> LayoutChoice | None:
        """The layout for `request`, a refusal (accepted=False, with the rate the free cpus carry), or None:
        no opinion."""


def load_chooser(spec: str | None, profile_dir: str | Path, config: Any = None) -> LayoutChooser:
    """A chooser from "module:attribute", or the built-in profile-cache chooser. `config` (the agent's
    InferenceConfig) switches on the measured search on deploy for the built-in one."""
    if not spec:
        return ProfileCacheChooser(profile_dir, search=SearchOnDeploy.from_config(config))
    module_name, _, attr = spec.partition(":")
    try:
        chooser = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ReamerError(f"inference.layout_chooser {spec!r} cannot be loaded: {exc}",
                          "give an importable 'module:function', or remove the key") from None
    _check_takes_one_request(spec, chooser)
    return chooser


def _check_takes_one_request(spec: str, chooser: Any) -> None:
    """Refuse at load, with the fix, a chooser the agent could not call with one LayoutRequest (a function of
    the five arguments choosers once took fails here, not at the first deploy)."""
    fix = ("make it `def choose(request: reamer.search.chooser.LayoutRequest) -> LayoutChoice | None` "
           "(request.model, .backend, .cpus, .slo_ms, .rate_rps, .max_batch, .samples, .precision)")
    if not callable(chooser):
        raise ReamerError(f"inference.layout_chooser {spec!r} is not callable", fix)
    try:
        inspect.signature(chooser).bind(LayoutRequest("", "", []))
    except TypeError as exc:
        raise ReamerError(f"inference.layout_chooser {spec!r} cannot be called with one LayoutRequest: {exc}",
                          fix) from None
    except ValueError:  # no signature to read (a builtin): it is called as it is
        pass


@dataclass(frozen=True)
class SearchOnDeploy:
    """How the built-in chooser measures a layout when no cached profile covers the free cpus."""

    budget_s: float = 90.0
    max_batch: int = 32
    warmup_s: float = 0.5
    window_s: float = 0.25

    @classmethod
    def from_config(cls, config: Any) -> "SearchOnDeploy | None":
        if config is None or not getattr(config, "search_on_deploy", False):
            return None
        return cls(budget_s=config.search_budget_s, max_batch=config.search_max_batch,
                   warmup_s=config.search_warmup_s, window_s=config.search_window_s)


class ProfileCacheChooser:
    """Cached profile -> plan_from_profile -> admit (no measuring, well under 100 ms).

    Without a cached profile that covers the free cpus it runs the layout search on exactly those
    cpus when `search` is set (they are idle at deploy; the searches of concurrent deploys take
    turns), caches the points, and admits on the best measured layout. Without `search`, or when
    the search cannot measure, it has no opinion (`reamer search MODEL` fills the cache)."""

    def __init__(self, profile_dir: str | Path, search: SearchOnDeploy | None = None,
                 margin: float = 0.10) -> None:
        self.profile_dir = Path(profile_dir)
        self.search = search
        self.margin = margin
        # set when the node reserves no cpu: front doors then share a layout's cores unless it leaves one idle
        # (reamer.plan.frontdoor), and layouts are charged this much cpu per request for them
        self.frontdoor_cpu_ms: float | None = None
        self._searching = threading.Lock()

    def __call__(self, request: LayoutRequest) -> LayoutChoice | None:
        """The job's largest batch bounds the batches searched (None: up to the configured search_max_batch);
        profiles are cached per traffic (shapes and data) and precision (OpenVINO at bf16 apart from f32)."""
        model, backend, cpus, slo_ms, rate_rps = (request.model, request.backend, list(request.cpus),
                                                  request.slo_ms, request.rate_rps)
        max_batch, samples, precision = request.max_batch, request.samples, request.precision
        if not cpus:
            return None
        choice = self._from_cache(model, backend, cpus, slo_ms, rate_rps, max_batch, samples, precision)
        if choice is not None or self.search is None:
            return choice
        asked = time.monotonic()
        with self._searching:  # concurrent deploys see the same free cpus: their searches take turns
            # a search that ran while we waited may have cached what we need
            return self._from_cache(model, backend, cpus, slo_ms, rate_rps, max_batch, samples, precision) or \
                self._measure(model, backend, cpus, slo_ms, rate_rps, max_batch,
                              budget_s=self.search.budget_s - (time.monotonic() - asked), samples=samples,
                              precision=precision)

    def _cached_points(self, model: str, backend: str, samples: "SampleSpec | None" = None,
                       precision: str = "f32") -> list:
        from reamer.serve.measure.profile_cache import ProfileCache, model_key

        if not self.profile_dir.is_dir():
            return []
        try:
            return ProfileCache(self.profile_dir).get(model_key(model, backend, samples=samples,
                                                                precision=precision)) or []
        except (OSError, ValueError) as exc:  # an unreadable cache is a miss, never a failed deploy
            log.debug("no profile for %s/%s: %s", model, backend, exc)
            return []

    def _from_cache(self, model: str, backend: str, cpus: list[int], slo_ms: float | None,
                    rate_rps: float | None, max_batch: int | None,
                    samples: "SampleSpec | None" = None, precision: str = "f32") -> LayoutChoice | None:
        from reamer.plan.admission import batch_latency_target_ms
        from reamer.plan.online_sim import with_sustained
        from reamer.plan.partition import NoFeasibleLayout
        from reamer.search.method import plan_from_profile

        backends = installed_backends() if backend == AUTO else [backend]
        plans, refusals = [], []
        for one in backends:
            points = [p for p in self._cached_points(model, one, samples, precision)
                      if max_batch is None or p.batch <= max_batch]
            # a profile measured on fewer cores than are free now is a miss when we may measure
            if not points or (self.search is not None and max(p.cores for p in points) < len(cpus)):
                return None  # "auto" plans only when every backend is cached: else it would never measure one
            try:
                plan = plan_from_profile(points, len(cpus), batch_latency_target_ms(slo_ms))
                if self.frontdoor_cpu_ms:
                    plan = self._frontdoor_counted(plan, points, len(cpus), batch_latency_target_ms(slo_ms))
                plans.append((one, plan, points))
            except NoFeasibleLayout as exc:
                refusals.append(exc.message)
        if not plans:
            return LayoutChoice(None, accepted=False, achievable_rps=0.0, reason="; ".join(refusals))
        one, candidate, points = max(plans, key=lambda item: item[1].rps)
        if slo_ms is not None:
            candidate = with_sustained(candidate, slo_ms, points)
        if backend == AUTO:
            candidate = replace(candidate, layout=candidate.layout.on(one))
        return self._admit(candidate, slo_ms, rate_rps, "planned from the cached profile")

    def _frontdoor_counted(self, plan: Any, points: list, n_cores: int, target_ms: float | None) -> Any:
        """The plan on all `n_cores` charged for the front door, or the plan on one core fewer if that carries more
        (reamer.plan.frontdoor)."""
        from reamer.plan.frontdoor import charge_candidates
        from reamer.plan.partition import NoFeasibleLayout
        from reamer.search.method import plan_from_profile

        charged = charge_candidates([plan], n_cores, self.frontdoor_cpu_ms or 0.0)[0]
        if n_cores < 2:
            return charged
        try:
            fewer = plan_from_profile(points, n_cores - 1, target_ms)
        except NoFeasibleLayout:
            return charged
        return fewer if fewer.rps > charged.rps else charged

    def _measure(self, model: str, backend: str, cpus: list[int], slo_ms: float | None,
                 rate_rps: float | None, max_batch: int | None, budget_s: float,
                 samples: "SampleSpec | None" = None, precision: str = "f32") -> LayoutChoice | None:
        """The search within `budget_s` (what is left of search.budget_s after waiting for another)."""
        from reamer.search.on_cores import MeasureSettings, batch_choices, search_layout

        assert self.search is not None
        s = self.search
        budget_s = max(budget_s, 1e-6)
        log.info("searching a layout for %s (%s, %s) on cpus %s, budget %.1fs", model, backend, precision, cpus,
                 budget_s)
        try:
            outcome = search_layout(model, backend, cpus, slo_ms, cache_dir=self.profile_dir,
                                    batches=batch_choices(min(s.max_batch, max_batch or s.max_batch)),
                                    budget_s=budget_s,
                                    settings=MeasureSettings(warmup_s=s.warmup_s, window_s=s.window_s),
                                    strict_cache=False, cache_source="agent deploy", samples=samples,
                                    precision=precision, frontdoor_cpu_ms=self.frontdoor_cpu_ms)
        except ReamerError as exc:  # the model would not run here: the job itself will say why
            log.warning("layout search for %s failed: %s", model, exc)
            return None
        log.info("layout search for %s: %s after %d run(s)%s", model,
                 outcome.best.layout if outcome.best else "nothing meets the SLO", len(outcome.rows),
                 "" if outcome.complete else f" ({outcome.note})")
        if outcome.best is None:
            if not outcome.complete and rate_rps is None:
                return None  # nothing measured in time and no rate to check: no opinion
            slo = f"the {slo_ms:g} ms SLO" if slo_ms is not None else "the SLO"
            reason = outcome.note or f"no layout on the free cores meets {slo}"
            if not outcome.complete:
                reason += "; raise inference.search_budget_s, or run `reamer search` for this model beforehand"
            return LayoutChoice(None, accepted=False, achievable_rps=0.0, reason=reason)
        how = "measured on the free cpus" if outcome.complete else outcome.note
        return self._admit(outcome.best, slo_ms, rate_rps, how)

    def _admit(self, candidate: Any, slo_ms: float | None, rate_rps: float | None, how: str) -> LayoutChoice:
        from reamer.plan.admission import admit
        from reamer.plan.layout import format_layout

        layout = format_layout(candidate.layout)
        if rate_rps is None or slo_ms is None:
            return LayoutChoice(layout, reason=how)
        decision = admit(candidate, rate_rps, slo_ms, margin=self.margin)
        return LayoutChoice(layout, decision.accepted, decision.achievable_rps, f"{decision.reason}; {how}")
