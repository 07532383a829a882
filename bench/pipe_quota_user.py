"""As an ordinary user (no host uid of each call's own), the jail's calls share the trainer's per-user pipe quota
(fs.pipe-user-pages-soft, 16384 pages): three calls holding every pipe their descriptors allow, and the size of a
pipe the trainer makes before, during and after (F_GETPIPE_SZ). Run it as that user, e.g. from root:

    setpriv --reuid 65534 --regid 65534 --clear-groups env HOME=/tmp PYTHONPATH=<site-packages with pyseccomp> \
        /usr/bin/python3 bench/pipe_quota_user.py
"""

import fcntl, os, sys, threading, time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox

HOLD = """import os, time
pipes = []
kids = []
for _ in range(30):
    pid = os.fork()
    if pid == 0:
        try:
            while True:
                pipes.append(os.pipe())
        except OSError:
            pass
        time.sleep(4)
        os._exit(0)
    kids.append(pid)
try:
    while True:
        pipes.append(os.pipe())
except OSError:
    pass
print('held', len(pipes), flush=True)
[os.waitpid(k, 0) for k in kids]
"""


def size():
    r, w = os.pipe()
    s = fcntl.fcntl(w, 1032)
    os.close(r)
    os.close(w)
    return s  # F_GETPIPE_SZ


print("uid", os.getuid(), "before", size())
ts = [threading.Thread(target=lambda: print(sandbox.run_program(HOLD, limits={"seconds": 8}))) for _ in range(3)]
[t.start() for t in ts]
time.sleep(2.5)
print("during", size())
[t.join() for t in ts]
print("after", size())
