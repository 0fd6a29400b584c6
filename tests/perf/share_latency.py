"""How soon `worker watch` takes a file that another machine writes onto a watched share (not a test).

    python tests/perf/share_latency.py MOUNT BACKING [--observer auto|native|polling] [--files 3]

MOUNT is a network mount of the folder BACKING (the "server" side), both reachable from here: files
written into BACKING/in appear under MOUNT/in without passing through this machine's kernel, as a
file another machine writes onto an NFS or SMB share does. One way to make such a pair on one Linux
machine (root, with the openssh-server and sshfs packages):

    mkdir -p /run/sshd /tmp/nas/backing /mnt/share && ssh-keygen -A
    ssh-keygen -q -t ed25519 -N '' -f ~/.ssh/id_ed25519 && cat ~/.ssh/id_ed25519.pub >> ~/.ssh/authorized_keys
    /usr/sbin/sshd -p 2222 -o ListenAddress=127.0.0.1 -o PermitRootLogin=yes
    sshfs -p 2222 -o StrictHostKeyChecking=no root@127.0.0.1:/tmp/nas/backing /mnt/share

(add `-o dir_cache=no` to the sshfs command for a share that does not cache its listings).

Starts `worker watch --inbox MOUNT/in` with the given observer (outbox, archive and database in a
temporary folder), writes a sample PNG into BACKING/in every 3.3 s (under a hidden name, then renamed),
and prints the time from each rename to its JSON in the outbox.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from worker import config
from worker.measure.samples import fetch_samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mount", type=Path)
    ap.add_argument("backing", type=Path)
    ap.add_argument("--observer", default="auto", choices=("auto", "native", "polling"))
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--model", default="efficientnet-lite0")
    args = ap.parse_args()
    sample = fetch_samples(config.load(None).cache_dir) / "coffee.png"
    work = Path(tempfile.mkdtemp(prefix="worker-share-"))
    inbox_server = args.backing / "in"
    shutil.rmtree(inbox_server, ignore_errors=True)
    inbox_server.mkdir(parents=True)
    (work / "config.yaml").write_text(f"watch:\n  observer: {args.observer}\n")
    log_path = work / "log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--config", str(work / "config.yaml"), "watch",
                                 "--inbox", str(args.mount / "in"), "--outbox", str(work / "out"), "--archive",
                                 str(work / "archive"), "--db", f"sqlite:///{work}/w.db", "--model", args.model],
                                stderr=log)
    try:
        while "watching" not in log_path.read_text():
            if proc.poll() is not None:
                sys.exit(f"worker watch exited:\n{log_path.read_text()}")
            time.sleep(0.1)
        print(next(line for line in log_path.read_text().splitlines() if "watching" in line))
        for i in range(args.files):
            tmp = inbox_server / f".s{i}.png"
            shutil.copy(sample, tmp)
            os.rename(tmp, inbox_server / f"s{i}.png")  # written on the server's side of the share
            t0 = time.monotonic()
            while not (work / "out" / f"s{i}.png.json").exists() and time.monotonic() - t0 < 120:
                time.sleep(0.05)
            print(f"s{i}.png: its JSON in the outbox after {time.monotonic() - t0:.1f} s", flush=True)
            time.sleep(3.3)
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"(outbox, archive, database and log in {work})")


if __name__ == "__main__":
    main()
