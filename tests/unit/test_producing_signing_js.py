"""docs/producing.md's JavaScript signing example, run as written under Node (issue 14: another language signs).

The ``js`` block of the "Signing" section runs with an identity from ``apportion keys init``'s format and a
stand-in ``producer`` that prints what it would send; the record must verify with ``apportion.identity.canonical.signer_of``
(the key it names, the user's) and decode as the ``JobSubmitted`` the block writes. A changed byte must not.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from apportion import events
from apportion.identity.canonical import signer_of
from tests.kit.signing import identity

DOC = (Path(__file__).resolve().parents[2] / "docs/producing.md").read_text()


def _js_block() -> str:
    section = DOC[DOC.index("## Signing") :]
    match = re.search(r"```js\n(.*?)```", section, re.S)
    assert match, "no ```js block in the Signing section of docs/producing.md"
    return match.group(1)


def test_the_javascript_example_signs_a_record_the_dispatcher_verifies(tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node, "Node.js is needed to check docs/producing.md's example (apt-get install nodejs)"
    alice = identity("alice")
    doc = alice.to_json()
    script = (
        f"const identity = {json.dumps(doc)};\n"
        "const producer = { send: (r) => process.stdout.write(JSON.stringify(r)) };\n" + _js_block()
    )
    (tmp_path / "sign.js").write_text(script)
    out = subprocess.run([node, str(tmp_path / "sign.js")], capture_output=True, text=True, timeout=60, check=True)
    sent = json.loads(out.stdout)
    [msg] = sent["messages"]
    value = msg["value"].encode()
    assert sent["topic"] == "apportion.submissions" and msg["key"] == "alice-0001"
    assert signer_of(value) == alice.public_key
    ev = events.decode(value)
    assert isinstance(ev, events.JobSubmitted) and (ev.user, ev.job_id, ev.signer_key) == (
        "alice", "alice-0001", alice.public_key
    )  # fmt: skip
    tampered = json.loads(value)
    tampered["gpus_per_replica"] = 8
    assert signer_of(json.dumps(tampered).encode()) is None
