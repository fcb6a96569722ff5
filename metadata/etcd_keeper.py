"""``python -m kvmesh.metadata.etcd_keeper [--remove DIR] -- ETCD ARGS``: etcd with someone to clean up after it.

EmbeddedEtcd starts etcd through this small process, which notices when the process
that started it is gone (it is re-parented; checked twice a second), even after a SIGKILL:

    owner gone         stop etcd, remove its data dir (``--remove``), exit
    SIGTERM / SIGINT   a clean stop (EmbeddedEtcd.stop): stop etcd, keep the data, exit
    etcd exits         exit with its status (a supervisor may start it again on the same data)

etcd itself dies with the keeper (PR_SET_PDEATHSIG), so nothing outlives the owner.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from kvmesh.lifecycle import die_with_parent


def main(argv: list[str]) -> int:
    owner = os.getppid()
    remove = None
    if argv[:1] == ["--remove"]:
        remove, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    etcd = subprocess.Popen(argv, preexec_fn=die_with_parent(signal.SIGKILL))

    def stop(signum, frame) -> None:
        etcd.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        try:
            return etcd.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if os.getppid() != owner:  # the owner died without stopping us
                etcd.terminate()
                code = etcd.wait()
                if remove:
                    shutil.rmtree(remove, ignore_errors=True)
                return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
