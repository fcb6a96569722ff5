"""``kvmesh status``: a live view of a cluster through its router (``GET /admin/status``).

Refreshes every ``--interval`` seconds until Ctrl-C; ``--once`` prints one view, ``--json`` the router's answer
as it is (for scripts). One table row per node (role, load, KV use, hit rate, measured links), then the
router's load and the last minute's requests by where their prompt tokens came from.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

CLEAR = "\x1b[H\x1b[2J"


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP address (kvmesh serve / router)")
    p.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY"),
                   help="the router's --api-key (default: $KVMESH_API_KEY)")
    p.add_argument("--once", action="store_true", help="print one view and exit")
    p.add_argument("--json", action="store_true", help="print the router's JSON answer (implies --once)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")


def run_status(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/").removesuffix("/v1") + "/admin/status"
    while True:
        try:
            view = fetch_view(url, args.api_key)
        except StatusError as e:
            print(f"kvmesh status: {e}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(view, indent=2))
            return 0
        text = render(view)
        if args.once:
            print(text)
            return 0
        sys.stdout.write(CLEAR + text + f"\n\n(every {args.interval:g} s; Ctrl-C to stop)\n")
        sys.stdout.flush()
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


class StatusError(Exception):
    pass


def fetch_view(url: str, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the router is ours: no proxy
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise StatusError(f"{url}: {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise StatusError(f"cannot reach the router at {url}: {getattr(e, 'reason', e)}") from None


def render(view: dict) -> str:
    header = ["node", "role", "in flight", "running", "KV used / cached / all", "hit rate", "host tier",
              "link GiB/s", "rtt ms"]
    rows = []
    for n in view["nodes"]:
        rows.append([n["node_id"], n["role"] + ("" if n["answering"] else " (silent)"), n["in_flight"], n["running"],
                     f"{n['kv_blocks_used']} / {n['kv_blocks_cached']} / {n['kv_blocks']}", f"{n['hit_rate']:.0%}",
                     n["host_tier_blocks"], f"{n['transfer_gib_per_s']:.2f}", f"{n['rtt_ms']:.1f}"])
    recent = view["recent"]
    tokens = recent["prompt_tokens"]
    total = sum(tokens.values())
    sources = ", ".join(f"{name} {count} ({count / total:.0%})" for name, count in tokens.items() if count) \
        if total else "none"
    lines = [f"cluster {view['cluster']}: {view['model']}, {len(view['nodes'])} nodes; router "
             f"{view['in_flight']} of {view['max_in_flight']} requests in flight", "", *_table(header, rows), "",
             f"last {recent['window_s']:g} s: {recent['num_requests']} requests, {total} prompt tokens by source: "
             f"{sources}"]
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
