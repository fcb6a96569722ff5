"""``kvmesh pin``: pin, unpin and list prefixes through a router's admin API (``/admin/pins``).

A pinned prefix (a shared system prompt) stays cached on every node that holds or later
computes it, whatever the traffic, until it is unpinned.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request


def add_pin_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP address (kvmesh serve / router)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", help="pin this text's tokens (full blocks of it)")
    what.add_argument("--tokens", help="pin these comma-separated token ids")
    what.add_argument("--unpin", metavar="ID", help="unpin the prefix with this id")
    what.add_argument("--list", action="store_true", help="list the pins and how many blocks each node holds")
    p.add_argument("--label", default="", help="a name shown in --list")
    p.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY"),
                   help="the router's --api-key (default: $KVMESH_API_KEY)")


def run_pin(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/").removesuffix("/v1") + "/admin/pins"
    if args.list:
        reply = _call("GET", base, None, args.api_key)
    elif args.unpin:
        reply = _call("DELETE", f"{base}/{args.unpin}", None, args.api_key)
    else:
        body = {"text": args.text} if args.text is not None else {
            "tokens": [int(t) for t in args.tokens.split(",") if t.strip()]}
        reply = _call("POST", base, {**body, "label": args.label}, args.api_key)
    if reply is None:
        return 1
    print(json.dumps(reply, indent=2))
    return 0


def _call(method: str, url: str, body: dict | None, api_key: str | None) -> dict | None:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, headers, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the router is ours: no proxy
    try:
        with opener.open(request, timeout=60) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except Exception:  # not our error shape
            message = e.reason
        print(f"kvmesh pin: {e.code}: {message}", file=sys.stderr)
    except urllib.error.URLError as e:
        print(f"kvmesh pin: cannot reach {url}: {e.reason}", file=sys.stderr)
    return None
