"""The real workload of the checkpoint tests (service and integration tiers), as the text of a script."""

#: A workload that resumes from its progress file: attempt 1 writes resumed+10, waits for ``go``, writes
#: resumed+20 and runs until SIGTERM, on which it writes one more (+5) and exits 0; later attempts write
#: resumed+10 as JSON and exit 0. Each attempt records what it found in ``seen-<attempt>.json``.
WORKLOAD = r"""
import json, os, signal, sys, time
ckpt, pf = os.environ["APPORTION_CHECKPOINT_DIR"], os.environ["APPORTION_PROGRESS_FILE"]
attempt = int(os.environ["APPORTION_ATTEMPT"])

def write(text):
    with open(pf + ".tmp", "w") as f:
        f.write(text)
    os.replace(pf + ".tmp", pf)

try:
    with open(pf) as f:
        raw = f.read()
    resumed = json.loads(raw)["progress_s"] if raw.lstrip().startswith("{") else float(raw)
except FileNotFoundError:
    resumed = 0.0
with open(os.path.join(ckpt, "seen-%d.json" % attempt), "w") as f:
    json.dump({"attempt": attempt, "resumed_s": resumed, "cwd": os.getcwd(), "job": os.environ["APPORTION_JOB_ID"]}, f)
print("attempt %d resumed from %s" % (attempt, resumed), flush=True)
progress = resumed

def on_term(signum, frame):
    write(repr(progress + 5))
    print("final checkpoint at %s" % (progress + 5), flush=True)
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
if attempt == 1:
    progress = resumed + 10
    write(repr(progress))
    while not os.path.exists(os.path.join(ckpt, "go")):
        time.sleep(0.01)
    progress = resumed + 20
    write(repr(progress))
    while True:
        time.sleep(1)
else:
    write(json.dumps({"progress_s": resumed + 10}))
"""
