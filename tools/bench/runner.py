"""The benchmark's cases: each contender's stores, checked against the local data, and every operation timed."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import torch
from tensordict import LazyStackedTensorDict, TensorDict

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tools._probes import commandstats
from tools.bench.learner import learner_case
from tools.bench.measure import Contender, OpOutcome, Target, _describe, measure
from tools.bench.report import _ratio, _row, _size
from tools.bench.workload import (
    CONTENDERS,
    EXTEND_ROWS,
    FILL_ROWS,
    TOKENS_PERIOD,
    RawFloor,
    RawLeaf,
    RefDense,
    RefLazy,
    Settings,
    _path_key,
    make_batch,
    make_element,
    make_large_stack,
    make_stack,
    materialize,
    raw_layout,
    same_data,
    tensor_bytes,
)
from tools.bench.writers import WriterPool


# --------------------------------------------------------------------------- cases
@dataclass
class Stores:
    """The working stores of one case, one per contender."""

    tdstore: LazyStackedTensorDictStore
    reference: Any
    raw: RawFloor
    stack: LazyStackedTensorDict
    leaves: list[RawLeaf]


class Runner:
    """Runs the cases and collects the report."""

    def __init__(self, target: Target, settings: Settings) -> None:
        self.target = target
        self.settings = settings
        self.run_id = uuid.uuid4().hex[:8]
        self.prefix = f"tdbench-{self.run_id}"
        self.client = target.client()
        self.stats_client: redis.Redis | None = target.client()
        try:
            commandstats(self.stats_client)
        except redis.RedisError:
            self.stats_client = None
        self.rng = np.random.default_rng(settings.seed)
        self.gen = torch.Generator().manual_seed(settings.seed + 1)
        self.results: list[dict[str, Any]] = []
        self.problems: list[str] = []  # tdstore or the raw floor failed: the run exits 1
        self.notes: list[str] = []  # the reference misbehaved: reported only
        self.mp_stores: dict[str, Stores] = {}
        self._refs: list[Any] = []

    # -- stores --------------------------------------------------------------
    def upload_all(self, case: str, stack: LazyStackedTensorDict) -> Stores:
        """The working stores of a case (untimed), checked against the local data."""
        td = LazyStackedTensorDictStore.from_lazy_stack(stack, url=self.target.url, prefix=f"{self.prefix}-td-{case}")
        ref = None
        if RefLazy is not None:
            try:
                ref = RefLazy.from_lazy_stack(stack, prefix=f"{self.prefix}-ref-{case}", **self.target.ref_kwargs)
                self._refs.append(ref)
            except Exception as err:  # pragma: no cover - reported, the run goes on
                self.notes.append(f"{case}: the reference could not upload: {_describe(err)}")
        leaves = raw_layout(stack)
        raw = RawFloor(self.client, f"{self.prefix}-raw-{case}", leaves)
        raw.upload()
        gathered = f"{self.prefix}-rawcheck-{case}"
        raw.upload_from(stack, gathered)
        for leaf in leaves:  # the plain upload stores what the floor does
            for kind in ("d", "o", "s") if leaf.het else ("d",):
                if self.client.get(raw.key(kind, leaf, gathered)) != self.client.get(raw.key(kind, leaf)):
                    self.problems.append(f"{case}: the plain upload's {kind!r} key of leaf {leaf.path} differs from the floor's")
        raw.drop(gathered)
        stores = Stores(td, ref, raw, stack, leaves)
        self.verify(case, stores)
        return stores

    def verify(self, case: str, s: Stores) -> None:
        """Spot-check a few elements of every contender against the local stack (untimed)."""
        count = len(s.stack.tensordicts)
        for i in sorted({0, count - 1, int(self.rng.integers(count))}):
            want = s.stack.tensordicts[i]
            got = s.tdstore[i].to_tensordict()
            if not same_data(got, want):
                self.problems.append(f"{case}: tdstore element {i} differs from the uploaded data")
            if s.reference is not None:
                with contextlib.suppress(Exception):
                    if not same_data(s.reference[i].to_tensordict(), want):
                        self.notes.append(f"{case}: reference element {i} differs from the uploaded data")
            pieces = iter(s.raw.read_element(i))
            for leaf in s.leaves:
                if leaf.het:
                    next(pieces), next(pieces)  # offset and shape records
                data = next(pieces)
                if data != bytes(tensor_bytes(want.get(_path_key(leaf.path)))):
                    self.problems.append(f"{case}: the raw floor's copy of element {i}, leaf {leaf.path}, differs")

    def check_written(self, case: str, op: str, s: Stores, written: tuple[int, TensorDict]) -> None:
        """The element written last (by every contender, in the last round) reads back from tdstore."""
        i, td = written
        if not same_data(s.tdstore[i].to_tensordict(), td):
            self.problems.append(f"{case}/{op}: tdstore element {i} does not read back what was written")

    def drop(self, s: Stores) -> None:
        with contextlib.suppress(Exception):
            s.tdstore.clear_redis()
            s.tdstore.close()
        if s.reference is not None:
            with contextlib.suppress(Exception):
                s.reference.clear_redis()
        keys = [s.raw.key(k, leaf) for leaf in s.leaves for k in ("d", "o", "s")]
        self.client.delete(*keys)

    def close(self) -> None:
        for ref in self._refs:
            with contextlib.suppress(Exception):
                ref.close()
        self.client.close()
        if self.stats_client is not None:
            self.stats_client.close()

    # -- recording -------------------------------------------------------------
    def record(self, case: str, op: str, outcomes: dict[str, OpOutcome], extra: dict[str, Any] | None = None) -> None:
        entry: dict[str, Any] = {"case": case, "op": op}
        for name in CONTENDERS:
            entry[name] = outcomes[name].summary() if name in outcomes else {"status": "unavailable"}
        td = entry["tdstore"].get("median_ms")
        for name, label in (("reference", "ratio_ref"), ("raw", "ratio_raw")):
            other = entry[name].get("median_ms")
            entry[label] = td / other if td and other else None
        if extra:
            entry.update(extra)
        self.results.append(entry)
        for name in ("tdstore", "raw"):
            if entry[name].get("status") != "ok":
                self.problems.append(f"{case}/{op}: {name} {entry[name].get('status')}: {entry[name].get('error', '')}")
        print(_row(entry), flush=True)

    def run(
        self, case: str, op: str, contenders: list[Contender], next_args: Callable[[], Any], extra: dict[str, Any] | None = None
    ) -> None:
        t0 = time.monotonic()
        outcomes = measure(contenders, next_args, reps=self.settings.reps_for(op), settings=self.settings, stats_client=self.stats_client)
        self.record(case, op, outcomes, {**(extra or {}), "seconds": round(time.monotonic() - t0, 2)})

    # -- the element cases -----------------------------------------------------
    def element_case(self, case: str, het: bool) -> None:
        """Upload, element/batch/slice/full reads and element writes on count elements."""
        st = self.settings
        stack = make_stack(st.count, het, st.seed + (1 if het else 0))
        s = self.upload_all(case, stack)
        lengths = np.array([1 + i % TOKENS_PERIOD for i in range(st.count)], dtype=np.int64)
        self.upload_op(case, s, stack)
        if not het:
            self.dense_upload_op(case, s)
        writes = self.element_ops(case, s, het, lengths)
        self.range_reads(case, s)
        if het:
            self.tokens_reads(case, s)
            self.shape_change_op(case, s, lengths, writes)
        if not het:
            self.ring_ops(case, s)
        self.mp_stores[case] = s  # kept for the side-by-side pass (and, homogeneous, the multi-process case)

    @staticmethod
    def _with_ref(s: Stores, make: Callable[[Any], Contender]) -> list[Contender]:
        """A contender per name, the reference left out when it is unavailable."""
        return [c for c in (make("tdstore"), make("reference") if s.reference is not None else None, make("raw")) if c is not None]

    def _batch_args(self) -> tuple[torch.Tensor, np.ndarray]:
        idx = torch.from_numpy(self.rng.integers(0, self.settings.count, size=self.settings.batch, dtype=np.int64))
        return idx, idx.numpy()

    def _slice_args(self) -> int:
        return int(self.rng.integers(0, self.settings.count - self.settings.batch + 1))

    def upload_op(self, case: str, s: Stores, stack: LazyStackedTensorDict) -> None:
        """Upload: a fresh store per call, deleted untimed."""

        def upload_td(_: Any) -> Any:
            return LazyStackedTensorDictStore.from_lazy_stack(stack, url=self.target.url, prefix=f"{self.prefix}-up")

        def upload_ref(_: Any) -> Any:
            return RefLazy.from_lazy_stack(stack, prefix=f"{self.prefix}-upref", **self.target.ref_kwargs)

        def drop_td(store: Any) -> None:
            store.clear_redis()
            store.close()

        def upload_raw(_: Any) -> str:
            base = f"{self.prefix}-upraw-{uuid.uuid4().hex[:6]}"
            s.raw.upload(base)
            return base

        up = [Contender("tdstore", upload_td, drop_td)]
        if s.reference is not None:
            up.append(Contender("reference", upload_ref, drop_td))
        up.append(Contender("raw", upload_raw, s.raw.drop))
        self.run(case, "upload", up, lambda: None)

        def upload_raw_gathered(_: Any) -> str:
            base = f"{self.prefix}-upgather-{uuid.uuid4().hex[:6]}"
            s.raw.upload_from(stack, base)
            return base

        # the same upload against a plain redis-py upload of the stack (tensordict's get per element and key, no checks)
        gathered = [Contender("tdstore", upload_td, drop_td), Contender("raw", upload_raw_gathered, s.raw.drop)]
        self.run(case, "upload_vs_plain_upload", gathered, lambda: None)

    def dense_upload_op(self, case: str, s: Stores) -> None:
        """The homogeneous elements as one dense TensorDict (``TensorDictStore.from_tensordict``), against
        the reference's ``TensorDictStore.from_tensordict`` and the raw floor of the same bytes."""
        dense = torch.stack(list(s.stack.tensordicts)).contiguous()

        def upload_td(_: Any) -> Any:
            return TensorDictStore.from_tensordict(dense, url=self.target.url, prefix=f"{self.prefix}-dn")

        def upload_ref(_: Any) -> Any:
            return RefDense.from_tensordict(dense, prefix=f"{self.prefix}-dnref", **self.target.ref_kwargs)

        def upload_raw(_: Any) -> str:
            base = f"{self.prefix}-dnraw-{uuid.uuid4().hex[:6]}"
            s.raw.upload(base)
            return base

        up = [Contender("tdstore", upload_td, _drop_store)]
        if RefDense is not None:
            up.append(Contender("reference", upload_ref, _drop_store))
        up.append(Contender("raw", upload_raw, s.raw.drop))
        self.run(case, "dense_upload", up, lambda: None)

    def element_ops(self, case: str, s: Stores, het: bool, lengths: np.ndarray) -> dict[str, Callable[[Any], Any]]:
        """Element read and element write; returns the writes (the shape-changing write reuses them)."""
        count, ref = self.settings.count, s.reference

        def elem_args() -> tuple[int, None]:
            return int(self.rng.integers(count)), None

        reads = {
            "tdstore": lambda a: s.tdstore[a[0]].to_tensordict(),
            "reference": lambda a: ref[a[0]].to_tensordict(),
            "raw": lambda a: s.raw.read_element(a[0]),
        }
        self.run(case, "element_read", self._with_ref(s, lambda n: Contender(n, reads[n])), elem_args)

        last: dict[str, Any] = {}

        def write_args() -> tuple[int, TensorDict, list]:
            i = int(self.rng.integers(count))
            td = make_element(i, het, self.gen, int(lengths[i]))
            last["write"] = (i, td)
            return i, td, s.raw.write_ops(i, td)

        writes: dict[str, Callable[[Any], Any]] = {
            "tdstore": lambda a: s.tdstore.__setitem__(a[0], a[1]),
            "reference": lambda a: ref.__setitem__(a[0], a[1]),
            "raw": lambda a: s.raw.write(a[2]),
        }
        self.run(case, "element_write", self._with_ref(s, lambda n: Contender(n, writes[n])), write_args)
        self.check_written(case, "element_write", s, last["write"])
        return writes

    def range_reads(self, case: str, s: Stores) -> None:
        """Batch, slice and full reads."""
        batch, ref = self.settings.batch, s.reference
        batches = {
            "tdstore": lambda a: s.tdstore[a[0]],
            "reference": lambda a: ref[a[0]],
            "raw": lambda a: s.raw.read_batch(a[1]),
        }
        self.run(case, "batch_read", self._with_ref(s, lambda n: Contender(n, batches[n])), self._batch_args, {"batch": batch})
        slices = {
            "tdstore": lambda a: materialize(s.tdstore[a : a + batch]),
            "reference": lambda a: materialize(ref[a : a + batch]),
            "raw": lambda a: s.raw.read_runs([(a, a + batch - 1)]),
        }
        self.run(case, "slice_read", self._with_ref(s, lambda n: Contender(n, slices[n])), self._slice_args, {"batch": batch})
        fulls = {
            "tdstore": lambda a: s.tdstore.to_tensordict(),
            "reference": lambda a: ref.to_tensordict(),
            "raw": lambda a: s.raw.read_all(),
        }
        self.run(case, "full_read", self._with_ref(s, lambda n: Contender(n, fulls[n])), lambda: None)

    def tokens_reads(self, case: str, s: Stores) -> None:
        """One tensor of the heterogeneous key instead of a lazy stack (the reference has no such read;
        the raw floor moves every key of the same rows)."""
        batch, ref = self.settings.batch, s.reference
        padded = {
            "tdstore": lambda a: s.tdstore.get_at("tokens", a[0], as_padded_tensor=True),
            "reference": lambda a: ref[a[0]].get("tokens", as_padded_tensor=True),
            "raw": lambda a: s.raw.read_batch(a[1]),
        }
        self.run(case, "padded_batch", self._with_ref(s, lambda n: Contender(n, padded[n])), self._batch_args, {"batch": batch})
        nested = {
            "tdstore": lambda a: s.tdstore.get_at("tokens", a[0], as_nested_tensor=True),
            "reference": lambda a: ref[a[0]].get("tokens", as_nested_tensor=True),
            "raw": lambda a: s.raw.read_batch(a[1]),
        }
        self.run(case, "nested_batch", self._with_ref(s, lambda n: Contender(n, nested[n])), self._batch_args, {"batch": batch})
        padded_slices = {
            "tdstore": lambda a: s.tdstore.get_at("tokens", slice(a, a + batch), as_padded_tensor=True),
            "reference": lambda a: ref[a : a + batch].get("tokens", as_padded_tensor=True),
            "raw": lambda a: s.raw.read_runs([(a, a + batch - 1)]),
        }
        self.run(case, "padded_slice", self._with_ref(s, lambda n: Contender(n, padded_slices[n])), self._slice_args, {"batch": batch})
        jagged_slices = {
            "tdstore": lambda a: s.tdstore.get_at("tokens", slice(a, a + batch), as_nested_tensor=True),
            "reference": lambda a: ref[a : a + batch].get("tokens", as_nested_tensor=True),
            "raw": lambda a: s.raw.read_runs([(a, a + batch - 1)]),
        }
        self.run(case, "nested_slice", self._with_ref(s, lambda n: Contender(n, jagged_slices[n])), self._slice_args, {"batch": batch})
        self.tokens_full_reads(case, s)

    def tokens_full_reads(self, case: str, s: Stores) -> None:
        """The heterogeneous key of the whole store, padded and nested."""
        ref = s.reference
        whole = {
            "tdstore": lambda a: s.tdstore.get("tokens", as_padded_tensor=True),
            "reference": lambda a: ref.get("tokens", as_padded_tensor=True),
            "raw": lambda a: s.raw.read_all(),
        }
        self.run(case, "padded_full", self._with_ref(s, lambda n: Contender(n, whole[n])), lambda: None)
        jagged = {
            "tdstore": lambda a: s.tdstore.get("tokens", as_nested_tensor=True),
            "reference": lambda a: ref.get("tokens", as_nested_tensor=True),
            "raw": lambda a: s.raw.read_all(),
        }
        self.run(case, "nested_full", self._with_ref(s, lambda n: Contender(n, jagged[n])), lambda: None)

    def shape_change_op(self, case: str, s: Stores, lengths: np.ndarray, writes: dict[str, Callable[[Any], Any]]) -> None:
        """An element write that changes the length of the heterogeneous key (last: the other reads rely on the lengths)."""
        last: dict[str, Any] = {}

        def change_args() -> tuple[int, TensorDict, list]:
            i = int(self.rng.integers(self.settings.count))
            new = int(lengths[i]) % TOKENS_PERIOD + 1  # always differs from the stored length
            lengths[i] = new
            td = make_element(i, True, self.gen, new)
            last["write"] = (i, td)
            return i, td, s.raw.write_ops(i, td)

        self.run(case, "shape_change_write", self._with_ref(s, lambda n: Contender(n, writes[n])), change_args)
        self.check_written(case, "shape_change_write", s, last["write"])

    def ring_ops(self, case: str, s: Stores) -> None:
        """``extend`` of ``EXTEND_ROWS`` rows at the ring's cursor, and a ``fill`` of ``FILL_ROWS`` rows in
        such extends (torchrl's benchmark workload). tdstore: ``store.extend`` (slots reserved and written
        in one atomic call); the reference: ``ref[a:a + n] = batch`` at the same cursor (what torchrl's
        ``StoreStorage`` does over it); raw: one ``SETRANGE`` per leaf of the rows' bytes, converted from
        the tensors in the call as the others do."""
        count, ref = self.settings.count, s.reference
        n = min(EXTEND_ROWS, count)
        layout = [(s.raw.key("d", leaf), _path_key(leaf.path), int(leaf.offsets[1])) for leaf in s.leaves]
        cursor = {"tdstore": 0, "reference": 0, "raw": 0}

        def at(name: str) -> int:
            a = cursor[name]
            cursor[name] = (a + n) % (count - count % n) if count >= n else 0
            return a

        def raw_rows(a: int, td: TensorDict) -> list:
            pipe = self.client.pipeline(transaction=False)
            for key, path, eb in layout:
                pipe.setrange(key, a * eb, tensor_bytes(td.get(path)))
            return pipe.execute()

        def ref_rows(td: TensorDict) -> None:
            a = at("reference")
            ref[a : a + n] = td

        ring: dict[str, Callable[[TensorDict], Any]] = {
            "tdstore": lambda td: s.tdstore.extend(td),
            "reference": ref_rows,
            "raw": lambda td: raw_rows(at("raw"), td),
        }
        names = [name for name in ring if name != "reference" or ref is not None]
        self.run(
            case, "extend", [Contender(name, lambda a, f=ring[name]: f(a)) for name in names], lambda: make_batch(n, self.gen), {"rows": n}
        )
        batches = [make_batch(n, self.gen) for _ in range(max(1, min(FILL_ROWS, count) // n))]
        fills = [Contender(name, lambda a, f=ring[name]: [f(b) for b in batches]) for name in names]
        self.run(case, "fill", fills, lambda: None, {"rows": n * len(batches), "per_extend": n})
        if not same_data(s.tdstore[(s.tdstore.write_count - 1) % count].to_tensordict(), batches[-1][-1]):
            self.problems.append(f"{case}/fill: tdstore's last extended row does not read back")

    # -- heterogeneous against homogeneous ------------------------------------------
    def het_vs_hom_case(self) -> list[dict[str, Any]]:
        """tdstore's heterogeneous reads against the same reads of the homogeneous store (same rows),
        or against the raw floor of the heterogeneous store for whole reads: timed side by side,
        alternating within each round, away from the reference's much slower calls (whose
        aftermath would fall on whichever read comes next)."""
        het, hom = self.mp_stores["heterogeneous"], self.mp_stores["homogeneous"]
        count, batch = self.settings.count, self.settings.batch

        def batch_args() -> torch.Tensor:
            return torch.from_numpy(self.rng.integers(0, count, size=batch, dtype=np.int64))

        def slice_args() -> slice:
            a = int(self.rng.integers(0, count - batch + 1))
            return slice(a, a + batch)

        tokens = {"padded": {"as_padded_tensor": True}, "nested": {"as_nested_tensor": True}}
        pairs: list[tuple[str, Callable[[Any], Any], str, Callable[[Any], Any], Callable[[], Any]]] = [
            ("batch_read", lambda a: het.tdstore[a], "homogeneous batch_read", lambda a: hom.tdstore[a], batch_args),
            (
                "slice_read",
                lambda a: materialize(het.tdstore[a]),
                "homogeneous slice_read",
                lambda a: materialize(hom.tdstore[a]),
                slice_args,
            ),
            (
                "full_read",
                lambda a: het.tdstore.to_tensordict(),
                "raw floor of heterogeneous full_read",
                lambda a: het.raw.read_all(),
                lambda: None,
            ),
        ]
        for kind, kw in tokens.items():
            pairs += [
                (
                    f"{kind}_batch",
                    lambda a, kw=kw: het.tdstore.get_at("tokens", a, **kw),
                    "homogeneous batch_read",
                    lambda a: hom.tdstore[a],
                    batch_args,
                ),
                (
                    f"{kind}_slice",
                    lambda a, kw=kw: het.tdstore.get_at("tokens", a, **kw),
                    "homogeneous slice_read",
                    lambda a: materialize(hom.tdstore[a]),
                    slice_args,
                ),
                (
                    f"{kind}_full",
                    lambda a, kw=kw: het.tdstore.get("tokens", **kw),
                    "raw floor of heterogeneous full_read",
                    lambda a: het.raw.read_all(),
                    lambda: None,
                ),
            ]
        out = []
        for op, mine, label, theirs, next_args in pairs:
            reps = self.settings.reps_for(op)
            got = measure(
                [Contender("het", mine), Contender("against", theirs)], next_args, reps=reps, settings=self.settings, stats_client=None
            )
            a, b = got["het"].summary().get("median_ms"), got["against"].summary().get("median_ms")
            out.append({"op": op, "against": label, "ms": a, "against_ms": b, "ratio": a / b if a and b else None})
            print(f"  {op:<14} {_ratio(out[-1]['ratio']):>8}  against {label}", flush=True)
        return out

    # -- the large leaf ----------------------------------------------------------
    def large_case(self, leaf_bytes: int) -> None:
        """A leaf of ``leaf_bytes`` over ``large_count`` elements, read and written whole."""
        st = self.settings
        case = "large" if leaf_bytes == min(st.large_leaf_bytes) else f"large_{_size(leaf_bytes)}"
        stack = make_large_stack(st.large_count, leaf_bytes, st.seed + 7)
        s = self.upload_all(case, stack)
        ref = s.reference
        (leaf,) = s.leaves
        key = s.raw.key("d", leaf)
        value = torch.randn(st.large_count, leaf_bytes // st.large_count // 4, generator=self.gen)
        value_bytes = tensor_bytes(value)
        extra = {"leaf_bytes": leaf_bytes, "count": st.large_count}
        reads = [Contender("tdstore", lambda a: s.tdstore["big"])]
        writes = [Contender("tdstore", lambda a: s.tdstore.__setitem__("big", value))]
        if ref is not None:
            reads.append(Contender("reference", lambda a: ref["big"]))
            writes.append(Contender("reference", lambda a: ref.__setitem__("big", value)))
        reads.append(Contender("raw", lambda a: self.client.get(key)))
        # the whole value is replaced: SET is the cheaper plain command for the same bytes
        writes.append(Contender("raw", lambda a: self.client.set(key, value_bytes)))
        self.run(case, "large_read", reads, lambda: None, extra)
        self.run(case, "large_write", writes, lambda: None, extra)
        if not torch.equal(s.tdstore["big"], value):
            self.problems.append(f"{case}: tdstore does not read back the large leaf it wrote")
        self.drop(s)

    # -- multi-process ------------------------------------------------------------
    def mp_case(self) -> dict[str, Any]:
        """``mp_writers`` processes doing ``store[i] = td`` for ``mp_seconds``, per contender."""
        st = self.settings
        s: Stores = self.mp_stores["homogeneous"]
        jobs: list[tuple[str, Any]] = [("tdstore", s.tdstore)]
        if s.reference is not None:
            jobs.append(("reference", s.reference))
        raw_spec = (self.target.url, [(s.raw.key("d", leaf), _path_key(leaf.path), int(leaf.offsets[1])) for leaf in s.leaves])
        jobs.append(("raw", raw_spec))
        report: dict[str, Any] = {"writers": st.mp_writers, "seconds": st.mp_seconds, "count": st.count}
        with WriterPool(st.mp_writers) as pool:
            for name, target in jobs:
                report[name] = pool.run(name, target, st.mp_seconds, st.count, st.seed)
                line = report[name]
                if line.get("status") == "ok":
                    print(
                        f"  mp {name:<10} {line['writes_per_s']:>12,.0f} element writes/s  "
                        f"({st.mp_writers} writers, {line['writes']:,} writes)",
                        flush=True,
                    )
                else:
                    print(f"  mp {name:<10} {line.get('status')}: {line.get('error')}", flush=True)
            report["learner"] = learner_case(pool, s.tdstore, s.reference, s.raw, jobs, self.settings, self.rng, self.client)
            if report["learner"].get("tdstore", {}).get("status") != "ok":
                self.problems.append(f"learner: tdstore {report['learner'].get('tdstore')}")
        td = report["tdstore"].get("writes_per_s")
        for name, label in (("reference", "ratio_ref"), ("raw", "ratio_raw")):
            other = report.get(name, {}).get("writes_per_s")
            report[label] = td / other if td and other else None
        for name in ("tdstore", "raw"):
            if report[name].get("status") != "ok":
                self.problems.append(f"mp: {name} {report[name].get('status')}: {report[name].get('error')}")
        self.drop(s)
        return report


def _drop_store(store: Any) -> None:
    store.clear_redis()
    store.close()
