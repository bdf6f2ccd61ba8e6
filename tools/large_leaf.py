#!/usr/bin/env python3
"""A leaf larger than one Redis string, round-tripped byte for byte (issue #5).

On a private redis-server with its default limits (one string holds at most 512 MiB,
``proto-max-bulk-len``), or on ``--url``, this uploads a stack whose one key holds
``--mib`` MiB in all (default 600) over ``--count`` elements, reads the key back whole
and compares every byte, replaces it whole with new bytes and compares again, and
reads a slice across segment boundaries.  It prints the times, the throughput, the
number of segments and the largest string on the server.  With ``--reference`` it
also tries the same upload with the reference ``tensordict.store``, which keeps a
leaf in one string, and reports what happens there.

    python -m tools.large_leaf [--mib 600] [--count 60] [--reference] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

import redis
import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore
from tdstore.server import server_or_url
from tools._probes import keys_under

MiB = 1 << 20


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (a float compare would call NaN != NaN and -0.0 == 0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _largest_string(client: redis.Redis, pattern: str) -> tuple[int, int]:
    """(number of string keys, largest STRLEN) among keys matching ``pattern``."""
    sizes = [client.strlen(k) for k in client.scan_iter(match=pattern, count=1000) if client.type(k) == b"string"]
    return len(sizes), max(sizes, default=0)


def run(url: str, mib: int, count: int, reference: bool) -> dict[str, Any]:
    per = mib * MiB // count // 4  # float32 values per element
    gen = torch.Generator().manual_seed(0)
    # random bits, NaN payloads included: a byte compare proves nothing was converted
    big = torch.randint(-(2**31), 2**31 - 1, (count, per), dtype=torch.int32, generator=gen).view(torch.float32)
    stack = lazy_stack([TensorDict(big=big[i], idx=torch.tensor(i)) for i in range(count)])
    leaf_mib = big.numel() * 4 / MiB
    prefix = f"large-{uuid.uuid4().hex[:6]}"
    out: dict[str, Any] = {"leaf_mib": leaf_mib, "count": count}
    client = redis.Redis.from_url(url)
    out["proto_max_bulk_len"] = int(client.config_get("proto-max-bulk-len").get("proto-max-bulk-len", 0))
    t0 = time.perf_counter()
    store = LazyStackedTensorDictStore.from_lazy_stack(stack, url=url, prefix=prefix)
    out["upload_s"] = time.perf_counter() - t0
    try:
        h = store._engine.header
        out["segments"] = h.segments.n
        out["elements_per_segment"] = h.segments.per
        out["string_keys"], out["largest_string"] = _largest_string(client, f"{prefix}:*")
        t0 = time.perf_counter()
        got = store["big"]
        out["read_s"] = time.perf_counter() - t0
        out["read_equal"] = _bytes_equal(got, big)
        del got
        new = torch.randint(-(2**31), 2**31 - 1, (count, per), dtype=torch.int32, generator=gen).view(torch.float32)
        t0 = time.perf_counter()
        store.set("big", new)
        out["write_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = store["big"]
        out["reread_s"] = time.perf_counter() - t0
        out["write_equal"] = _bytes_equal(again, new)
        del again
        lo, hi = max(0, h.segments.per - 2), min(count, 3 * h.segments.per + 1)
        out["slice"] = [lo, hi]
        out["slice_equal"] = _bytes_equal(store[lo:hi]["big"], new[lo:hi])
    finally:
        store.clear_redis()
    out["keys_left"] = len(keys_under(client, prefix))
    if reference:
        out["reference"] = _reference(url, stack, prefix + "-ref", client)
    client.close()
    return out


def _reference(url: str, stack: Any, prefix: str, client: redis.Redis) -> dict[str, Any]:
    """What the reference ``tensordict.store`` does with the same stack on the same server."""
    try:
        from tensordict.store import LazyStackedTensorDictStore as RefLazy
    except ImportError as err:
        return {"status": "unavailable", "error": str(err)}
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    kw: dict[str, Any] = (
        {"unix_socket_path": unquote(parts.path)} if parts.scheme == "unix" else {"host": parts.hostname, "port": parts.port}
    )
    t0 = time.perf_counter()
    try:
        ref = RefLazy.from_lazy_stack(stack, prefix=prefix, **kw)
        status: dict[str, Any] = {
            "status": "ok",
            "read_equal": _bytes_equal(ref["big"], torch.stack([td["big"] for td in stack.tensordicts])),
        }
    except Exception as err:  # what a user of the reference sees
        status = {"status": "raises", "error": f"{type(err).__name__}: {str(err)[:160]}"}
    status["seconds"] = time.perf_counter() - t0
    keys = keys_under(client, prefix)
    status["keys_left"] = len(keys)
    if keys:
        client.delete(*keys)
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="server URL (default: a private redis-server with default limits)")
    ap.add_argument("--mib", type=int, default=600, help="size of the leaf in MiB (default 600)")
    ap.add_argument("--count", type=int, default=60, help="elements (default 60)")
    ap.add_argument("--reference", action="store_true", help="also try the reference tensordict.store")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--binary", help="redis-server binary for the private server (default: /usr/bin/redis-server if present)")
    args = ap.parse_args(argv)
    with server_or_url(args.url, args.binary) as (url, where):
        r = run(url, args.mib, args.count, args.reference)
    r["server"] = where
    print(where)
    print(f"leaf {r['leaf_mib']:.0f} MiB over {r['count']} elements; the server's largest string: {r['proto_max_bulk_len'] / MiB:.0f} MiB")
    print(
        f"segments {r['segments']} ({r['elements_per_segment']} elements each), {r['string_keys']} string keys, "
        f"largest {r['largest_string'] / MiB:.1f} MiB"
    )
    for what, key in (("upload", "upload_s"), ("read whole", "read_s"), ("write whole", "write_s"), ("read again", "reread_s")):
        print(f"{what:>12}: {r[key]:6.2f} s  {r['leaf_mib'] / r[key]:7.0f} MiB/s")
    ok = r["read_equal"] and r["write_equal"] and r["slice_equal"] and r["keys_left"] == 0
    print(
        f"byte for byte: upload {'equal' if r['read_equal'] else 'DIFFERENT'}, write {'equal' if r['write_equal'] else 'DIFFERENT'}, "
        f"slice {r['slice']} {'equal' if r['slice_equal'] else 'DIFFERENT'}; keys left after clear: {r['keys_left']}"
    )
    if "reference" in r:
        ref = r["reference"]
        print(f"reference: {ref['status']} {ref.get('error', '')} ({ref['seconds']:.1f} s, {ref['keys_left']} keys left behind)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
