"""The search: estimator-guided bisection on the micro-batch per group, early stop, pruning, a trial cache.

A *group* is one strategy × precision × global batch. In each group, with activation checkpointing and compile
off and the default thread count:

1. The memory estimate prunes every micro-batch that cannot fit the budget, before anything runs.
2. The largest micro-batch the estimate allows is run; if it runs out of memory, bisection over the smaller
   divisors finds the largest that really fits (the estimator is a guide, the trial decides).
3. From there the search walks to smaller micro-batches while each is at least `min_gain` faster than the best so
   far (early stop when gains fall below 2 % by default).
4. Only when memory stopped the group below its largest micro-batch is activation checkpointing tried, at the
   larger micro-batches it lets fit; at a micro-batch that fits without it, checkpointing is dominated (the same
   math plus recomputation) and pruned without running.

A group whose first trial is below `dominated_below` × the best tokens/s so far is not explored further; a group
whose first trial crashes (e.g. a strategy whose library is missing) is given up. Finally, the best configuration
is refined one axis at a time (threads per rank on CPU, then `torch.compile`), each change kept only if it gains
`min_gain`.

The winner is the search's incumbent: a measured trial replaces it only when it is `min_gain` faster (each group's
own choice first, then its other trials, then the refinement's). One measurement of a trial varies by a few percent,
so the plain maximum would pick noise: two 1 % "gains" the walk itself rejected would add up to a winner.

Every trial is appended to a cache, so a re-run with the same config and settings resumes. Results that say
something about the configuration (ok, out of memory) are reused; a crash or a timeout may have been the host's
(a port in use, a busy machine, a full disk), so it is run again.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from gaudi3_scale.config.errors import ConfigError, UserInputError, brief
from gaudi3_scale.tune.config import TuneConfig
from gaudi3_scale.tune.space import Candidate, SearchSpace, offload_options
from gaudi3_scale.tune.trial import TrialResult

__all__ = ["SearchOutcome", "TrialCache", "search"]

RunFn = Callable[[Candidate, int | None], TrialResult]
EstimateFn = Callable[[Candidate], int | None]
# why a candidate's run config (its best.yaml) would be refused; None: it would not
RefusalFn = Callable[[Candidate], str | None]

# Cached results reused on a re-run: what the configuration itself decided, not what the host may have caused.
REUSED_STATUSES = ("ok", "oom")


class TrialCache:
    """Trials already run for this config and settings (`trials.jsonl`, one JSON object per line).

    A line that is not JSON is skipped: a killed tuner leaves its last line cut short. Any other line that is not a
    trial record (another JSON value, bytes that are not UTF-8, a record of this config whose result does not read
    back) is a `UserInputError` naming the file and line: the tuner opens the cache before it writes anything.
    """

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.results: dict[str, TrialResult] = {}
        if path.is_file():
            for number, line in enumerate(path.read_bytes().splitlines(), 1):
                result = self._read_line(number, line)
                if result is not None:
                    self.results[result.key] = result

    def _read_line(self, number: int, line: bytes) -> TrialResult | None:
        """The result on line `number` when it is one of this fingerprint's; None for another's or a torn line."""
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            byte = f"0x{line[exc.start]:02x}"
            raise self._damaged(number, f"byte {byte} at column {exc.start + 1} is not UTF-8") from None
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            return None  # a line cut short by a killed tuner
        except (ValueError, RecursionError) as exc:  # a 5,000-digit integer, [[[[… nested past the C decoder
            raise self._damaged(number, f"{type(exc).__name__}: {exc}") from None
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("fingerprint"), str)
            or "result" not in record
        ):
            raise self._damaged(number, f'expected {{"fingerprint": …, "result": …}}, got {brief(text)}')
        if record["fingerprint"] != self.fingerprint:
            return None  # a trial of another config or settings: kept in the file, not reused
        try:
            return TrialResult.from_dict(record["result"])
        except ConfigError as exc:
            raise self._damaged(number, str(exc)) from None

    def _damaged(self, number: int, problem: str) -> UserInputError:
        return UserInputError(
            f"{self.path}:{number}: not a trial record ({problem}); delete the line or use a new --out"
        )

    def get(self, key: str) -> TrialResult | None:
        return self.results.get(key)

    def add(self, result: TrialResult) -> None:
        self.results[result.key] = result
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as f:
            if f.tell() and not _ends_with_newline(self.path):
                f.write(b"\n")  # after a line cut short: the record gets a line of its own
            f.write(
                json.dumps({"fingerprint": self.fingerprint, "result": result.to_dict()}).encode() + b"\n"
            )


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


@dataclass
class SearchOutcome:
    results: list[TrialResult]
    best: TrialResult | None
    limit: str
    trials_run: int
    trials_cached: int
    wall_s: float
    skipped_for_time: int = 0
    notes: list[str] = field(default_factory=list)

    def ranked(self) -> list[TrialResult]:
        """Measured trials fastest first, then failed ones, then pruned and skipped points."""
        order = {"ok": 0, "oom": 1, "timeout": 2, "crash": 3, "pruned": 4, "skipped": 5}
        return sorted(self.results, key=lambda r: (order[r.status], -(r.tokens_per_s or 0.0)))


class _Search:
    def __init__(
        self,
        space: SearchSpace,
        config: TuneConfig,
        run: RunFn,
        estimate: EstimateFn,
        cache: TrialCache,
        on_result: Callable[[TrialResult, bool], None] | None,
        refusal: RefusalFn | None = None,
    ) -> None:
        self.space, self.config, self.run_fn, self.estimate, self.cache = space, config, run, estimate, cache
        self.on_result = on_result
        self.refusal = refusal or (lambda c: None)
        self.results: dict[str, TrialResult] = {}
        self.incumbent: TrialResult | None = None  # the winner so far (see the module's docstring)
        self.challenged: set[str] = set()  # keys of the ok results already put against the incumbent
        self.rerun_failed = 0  # cached crashes and timeouts run again
        self.started = time.perf_counter()
        self.trials_run = 0
        self.trials_cached = 0
        self.skipped_for_time = 0
        self.trial_walls: list[float] = []
        self.notes: list[str] = []

    # -- one point ---------------------------------------------------------------------------------------------
    def evaluate(self, c: Candidate) -> TrialResult:
        if c.key in self.results:
            return self.results[c.key]
        refused = self.refusal(c)
        if refused is not None:
            result = TrialResult(
                candidate=c, status="pruned", reason=f"not run: its best.yaml would be refused: {refused}"
            )
            return self._record(result, cached=False)
        budget = self.config.memory_budget_bytes if self.config.prune_by_estimate else None
        estimate = self.estimate(c)
        if budget is not None and estimate is not None and estimate > budget:
            result = TrialResult(
                candidate=c,
                status="pruned",
                estimate_bytes=estimate,
                reason=f"estimated {estimate / 2**30:.2f} GiB > budget {budget / 2**30:.2f} GiB: not run",
            )
            return self._record(result, cached=False)
        cached = self.cache.get(c.key)
        if cached is not None and cached.status in REUSED_STATUSES:
            self.trials_cached += 1
            return self._record(cached, cached=True)
        if cached is not None and cached.ran:
            self.rerun_failed += 1
        if self._out_of_time():
            self.skipped_for_time += 1
            result = TrialResult(candidate=c, status="skipped", estimate_bytes=estimate, reason="time budget")
            return self._record(result, cached=False)
        result = self.run_fn(c, estimate)
        self.trials_run += 1
        self.trial_walls.append(result.wall_s)
        self.cache.add(result)
        return self._record(result, cached=False)

    def _record(self, result: TrialResult, *, cached: bool) -> TrialResult:
        self.results[result.key] = result
        if self.on_result is not None:
            self.on_result(result, cached)
        return result

    def prune(self, c: Candidate, reason: str) -> None:
        if c.key not in self.results:
            self._record(TrialResult(candidate=c, status="pruned", reason=reason), cached=False)

    def _out_of_time(self) -> bool:
        limit = self.config.time_budget_s
        if limit is None:
            return False
        elapsed = time.perf_counter() - self.started
        typical = sorted(self.trial_walls)[len(self.trial_walls) // 2] if self.trial_walls else 0.0
        return elapsed + typical > limit

    def challenge(self, result: TrialResult | None) -> None:
        """`result` replaces the incumbent when it is `min_gain` faster; each result is put against it once."""
        if result is None or result.status != "ok" or result.key in self.challenged:
            return
        self.challenged.add(result.key)
        if self._faster(result, self.incumbent):
            self.incumbent = result

    def _faster(self, result: TrialResult, than: TrialResult | None) -> bool:
        if result.status != "ok":
            return False
        if than is None:
            return True
        return (result.tokens_per_s or 0.0) >= (than.tokens_per_s or 0.0) * (1 + self.config.min_gain)

    # -- one group ---------------------------------------------------------------------------------------------
    def fits_somewhere(self, base: Candidate) -> bool:
        """Whether the estimate lets any micro-batch of `base`'s group fit, with or without checkpointing."""
        budget = self.config.memory_budget_bytes if self.config.prune_by_estimate else None
        if budget is None:
            return True
        for m in self.space.micro_batches(base.global_batch_size, base.tp_size, base.pp_size):
            for ckpt in self.space.activation_checkpointing:
                estimate = self.estimate(replace(base, micro_batch_size=m, activation_checkpointing=ckpt))
                if estimate is None or estimate <= budget:
                    return True
        return False

    def group(self, base: Candidate) -> None:
        """Search `base`'s group; its own choice challenges the incumbent first, then its other measured trials (so
        no trial of the search ends `min_gain` faster than the winner)."""
        first_new = len(self.results)
        self.challenge(self._group(base))
        for r in list(self.results.values())[first_new:]:
            self.challenge(r)

    def _group(self, base: Candidate) -> TrialResult | None:
        """The group's choice: its largest micro-batch that fits, replaced by a smaller one or by activation
        checkpointing only when that is `min_gain` faster."""
        mbs = self.space.micro_batches(base.global_batch_size, base.tp_size, base.pp_size)
        refused = self.refusal(replace(base, micro_batch_size=mbs[-1]))
        if refused is not None:
            self.evaluate(replace(base, micro_batch_size=mbs[-1]))  # recorded as pruned, with why
            self.notes.append(f"{_group_name(base)}: not searched: its best.yaml would be refused: {refused}")
            return None
        at = {m: replace(base, micro_batch_size=m) for m in mbs}
        budget = self.config.memory_budget_bytes if self.config.prune_by_estimate else None

        def fits(c: Candidate) -> bool:
            estimate = self.estimate(c)
            return budget is None or estimate is None or estimate <= budget

        allowed = [m for m in mbs if fits(at[m])]
        for m in mbs:
            if m not in allowed:
                self.evaluate(at[m])  # records it as pruned by the estimate
        group_best: TrialResult | None = None
        top: int | None = None  # index into mbs of the largest micro-batch that really fits
        if allowed:
            hi = mbs.index(allowed[-1])
            first = self.evaluate(at[mbs[hi]])
            if first.status in ("crash", "timeout"):
                self.notes.append(f"{_group_name(base)}: given up after its first trial ({first.status})")
                return None
            if first.status == "ok":
                top = hi
            else:  # out of memory: bisect below
                lo, hi = 0, hi - 1
                while lo <= hi:
                    mid = (lo + hi) // 2
                    r = self.evaluate(at[mbs[mid]])
                    if r.status == "ok":
                        top, lo = mid, mid + 1
                    elif r.status == "oom":
                        hi = mid - 1
                    else:
                        break
            if top is not None:
                group_best = self.results[at[mbs[top]].key]
                overall = self.incumbent
                if (
                    overall is not None
                    and overall is not group_best
                    and (group_best.tokens_per_s or 0.0)
                    < (overall.tokens_per_s or 0.0) * self.config.dominated_below
                ):
                    self.notes.append(
                        f"{_group_name(base)}: not explored further "
                        f"(< {self.config.dominated_below:.0%} of the best so far)"
                    )
                else:
                    for i in range(top - 1, -1, -1):
                        r = self.evaluate(at[mbs[i]])
                        if not self._faster(r, group_best):
                            break
                        group_best = r
        # Activation checkpointing: only where memory, not the batch, stopped the group.
        if True not in self.space.activation_checkpointing:
            return group_best
        limit = top if top is not None else -1
        for i, m in enumerate(mbs):
            if i <= limit:
                self.prune(
                    replace(at[m], activation_checkpointing=True),
                    "dominated: fits without activation checkpointing, which only adds recomputation",
                )
        larger = [replace(at[m], activation_checkpointing=True) for m in mbs[limit + 1 :]]
        if larger:
            for c in reversed(
                [c for c in larger if fits(c)][-3:]
            ):  # the largest that may fit, at most 3 tries
                r = self.evaluate(c)
                if self._faster(r, group_best):
                    group_best = r
                if r.status != "oom":
                    break
            for c in larger:
                if not fits(c):
                    self.evaluate(c)
        return group_best

    # -- refinement of the winner ---------------------------------------------------------------------------
    def refine(self) -> None:
        """Refine the incumbent one axis at a time; each change is kept only when `min_gain` faster."""
        best = self.incumbent
        if best is None:
            return
        base = best.candidate
        for threads in self.space.threads:
            if threads != base.threads:
                r = self.evaluate(replace(base, threads=threads))
                if self._faster(r, best):
                    best = r
        base = best.candidate
        if True in self.space.compile and not base.compile and base.strategy != "deepspeed_zero3":
            r = self.evaluate(replace(base, compile=True))
            if self._faster(r, best):
                best = r
        base = best.candidate
        # CUDA graphs replay a whole step's kernels with one launch: worth it where launches bound the step.
        if self.space.cuda_graphs and base.compile and base.strategy in ("auto", "ddp"):
            r = self.evaluate(replace(base, compile_mode="reduce-overhead"))
            if self._faster(r, best):
                best = r
        self.incumbent = best

    def limit_line(self, best: TrialResult | None) -> str:
        if best is None:
            if self.skipped_for_time:
                return "time budget: it ran out before any trial finished"
            counts = Counter(r.status for r in self.results.values() if r.ran)
            if not counts:
                return "memory: the estimate prunes every configuration at this budget"
            if set(counts) == {"oom"}:
                return "memory: no configuration fits (every trial ran out of memory)"
            return (
                "failures: no trial finished ("
                + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                + ")"
            )
        c = best.candidate
        mbs = self.space.micro_batches(c.global_batch_size, c.tp_size, c.pp_size)
        bigger = [replace(c, micro_batch_size=m) for m in mbs if m > c.micro_batch_size]
        if self.skipped_for_time:
            return f"time budget: {self.skipped_for_time} planned trial(s) skipped"
        if not bigger and c.pp_size > 1:
            return (
                f"search space: micro-batch {c.micro_batch_size} is the largest that leaves the pipeline its "
                f"{c.pp_size} micro-batches a step (1F1B); only a larger global batch could go further"
            )
        if not bigger:
            return (
                f"search space: micro-batch {c.micro_batch_size} is the whole per-rank batch (no accumulation); "
                "only a larger global batch could go further"
            )
        # The group ran its micro-batches at its starting threads with compile off (see `search`); the
        # refinement may have moved the winner's threads or compile since, and never ran another micro-batch.
        ran_at = replace(bigger[0], threads=self.space.threads[0], compile=False, compile_mode="default")
        nxt = self.results.get(bigger[0].key) or self.results.get(ran_at.key)
        if nxt is not None and (nxt.status == "oom" or (nxt.status == "pruned" and "budget" in nxt.reason)):
            return f"memory: micro-batch {bigger[0].micro_batch_size} does not fit ({nxt.reason})"
        return (
            f"throughput plateau: no other micro-batch, thread count or compile setting was "
            f"{self.config.min_gain:.0%} faster"
        )

    def noise_note(self, best: TrialResult | None) -> str | None:
        """A line when a trial measured faster than the winner, by less than `min_gain`: the tables rank it first."""
        ok = [r for r in self.results.values() if r.status == "ok"]
        fastest = max(ok, key=lambda r: r.tokens_per_s or 0.0, default=None)
        if best is None or fastest is None or (fastest.tokens_per_s or 0.0) <= (best.tokens_per_s or 0.0):
            return None
        gain = (fastest.tokens_per_s or 0.0) / (best.tokens_per_s or 1.0) - 1
        return (
            f"{fastest.candidate.label(self.space.world_size)} measured {gain:.1%} faster than the winner, under "
            f"min_gain {self.config.min_gain:.0%}: within one measurement's noise, so the search kept its incumbent"
        )


def _group_name(c: Candidate) -> str:
    return f"{c.layout_name()} {c.precision} global batch {c.global_batch_size}"


def _with_offload(s: _Search, base: Candidate) -> None:
    """A group that fits nowhere on the device: search it again with CPU offload (optimizer before all, the
    lighter host traffic first), if the strategy offloads and the estimate then fits."""
    for offload in offload_options(base.strategy):
        moved = replace(base, offload=offload)
        if s.fits_somewhere(moved):
            s.notes.append(
                f"{_group_name(base)}: does not fit on the device; searched with offload {offload}"
            )
            s.group(moved)
            return


def search(
    space: SearchSpace,
    config: TuneConfig,
    *,
    run: RunFn,
    estimate: EstimateFn,
    cache: TrialCache,
    on_result: Callable[[TrialResult, bool], None] | None = None,
    refusal: RefusalFn | None = None,
) -> SearchOutcome:
    """Search `space`; `run` executes one trial (see trial.run_trial), `estimate` gives bytes per rank, `refusal`
    why a candidate's best.yaml would be refused (such a candidate is pruned, never run)."""
    s = _Search(space, config, run, estimate, cache, on_result, refusal)
    default_threads = space.threads[0]
    for strategy, (tp, pp, split) in ((st, m) for st in space.strategies for m in space.meshes_for(st)):
        for precision in space.precisions:
            for gb in space.global_batches:
                mbs = space.micro_batches(gb, tp, pp)
                if not mbs:
                    continue  # too few sequences for the pipeline's micro-batches
                base = Candidate(
                    strategy=strategy,
                    precision=precision,
                    global_batch_size=gb,
                    micro_batch_size=mbs[-1],
                    activation_checkpointing=False,
                    compile=False,
                    threads=default_threads,
                    tp_size=tp,
                    pp_size=pp,
                    pp_split=split,
                )
                s.group(base)
                if not s.fits_somewhere(base):
                    _with_offload(s, base)
    s.refine()
    best = s.incumbent
    if s.rerun_failed:
        s.notes.insert(0, f"re-running {s.rerun_failed} trials that crashed or timed out last time")
    if (noise := s.noise_note(best)) is not None:
        s.notes.append(noise)
    return SearchOutcome(
        results=list(s.results.values()),
        best=best,
        limit=s.limit_line(best),
        trials_run=s.trials_run,
        trials_cached=s.trials_cached,
        wall_s=time.perf_counter() - s.started,
        skipped_for_time=s.skipped_for_time,
        notes=s.notes,
    )
