"""Run by tests/test_node_forkserver.py inside a forked child: reports what it inherited, echoes stdin lines,
exits with the code its first argument names once stdin closes."""
from __future__ import annotations

import json
import os
import signal
import sys

if __name__ == "__main__":
    fd = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "probe": os.environ.get("KVMESH_PROBE"),
                      "token": os.environ.get("KVMESH_CLUSTER_TOKEN"),
                      "passed": os.pread(fd, 5, 0).decode() if fd >= 0 else None,
                      "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                      "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                      "torch_loaded": "torch" in sys.modules,
                      "comm": open(f"/proc/{os.getpid()}/comm").read().strip()}), flush=True)
    if len(sys.argv) > 3:
        print("stderr " + sys.argv[3], file=sys.stderr, flush=True)
    for line in sys.stdin:
        print("echo " + line.strip(), flush=True)
    sys.exit(int(sys.argv[1]))
