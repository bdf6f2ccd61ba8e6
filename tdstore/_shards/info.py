"""A sharded ring as ``tdstore ls`` and ``tdstore info`` show it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tdstore._format.keys import StoreKeys
from tdstore._shards.layout import Layout


def node_of_key(client: Any, key: str) -> str:
    """The node (``host:port``) holding ``key`` on a cluster, ``"-"`` off one."""
    try:
        return str(client.get_node_from_key(key).name) if hasattr(client, "get_node_from_key") else "-"
    except Exception:
        return "?"


def group_shards(stores: Sequence[Any]) -> tuple[list[Any], dict[str, list[tuple[int, Any]]]]:
    """Store listings (``StoreInfo``) cut into (the ordinary stores, the shards of each sharded ring by ring id)."""
    from tdstore._format.keys import shard_of_id

    plain, rings = [], {}  # type: ignore[var-annotated]
    for info in stores:
        found = shard_of_id(info.td_id)
        if found is None:
            plain.append(info)
        else:
            rings.setdefault(found[0], []).append((found[1], info))
    return plain, {ring: sorted(parts, key=lambda p: p[0]) for ring, parts in rings.items()}


def ring_info(client: Any, prefix: str, td_id: str) -> dict[str, Any] | None:
    """A sharded ring as ``tdstore info`` shows it: its layout and, per shard, store id, node, count and fill
    (one read per shard); None when ``td_id`` is no sharded ring."""
    keys = StoreKeys(prefix, td_id)
    text = client.get(keys.shards)
    if text is None:
        return None
    layout = Layout.from_json(text, f"td_id={td_id!r}")
    shards = []
    for k, (sid, count) in enumerate(zip(layout.ids, layout.counts)):
        meta = StoreKeys(prefix, sid).meta
        rw = client.hget(meta, "rw")
        exists = bool(client.exists(meta))
        rw_n = int(rw) if rw is not None else 0
        shards.append(
            {"shard": k, "td_id": sid, "node": node_of_key(client, meta), "count": count, "written": min(rw_n, count),
             "write_count": rw_n, "present": exists}
        )  # fmt: skip
    return {
        "td_id": td_id,
        "prefix": prefix,
        "kind": "sharded ring",
        "count": layout.count,
        "stack_dim": layout.stack_dim,
        "inner": list(layout.inner),
        "written": sum(s["written"] for s in shards),
        "write_count": sum(s["write_count"] for s in shards),
        "layout_node": node_of_key(client, keys.shards),
        "shards": shards,
    }


def ring_info_lines(info: dict[str, Any], where: str) -> list[str]:
    lines = [
        f"sharded ring {info['td_id']} under prefix {info['prefix']!r} on {where}",
        f"  slots: {info['count']} in {len(info['shards'])} shards, written {info['written']}/{info['count']}, "
        f"{info['write_count']} ring writes; layout key on {info['layout_node']}",
    ]
    for s in info["shards"]:
        fill = f"{s['written']}/{s['count']}" if s["present"] else "MISSING"
        lines.append(f"  shard {s['shard']}: {s['td_id']} on {s['node']}, {fill}")
    return lines
