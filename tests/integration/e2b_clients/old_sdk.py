"""An older E2B Python SDK (e2b 2.44.0, e2b-code-interpreter 2.10.0; scripts/install-e2b-clients.sh),
unchanged, against branchboxd's E2B endpoint: the routes it calls (`POST /sandboxes`,
`POST /sandboxes/{id}/connect`) are older than the current SDK's `/v2` ones. Run with that SDK's
venv; prints one JSON object of what it saw."""
import json
import os

from e2b import Sandbox
from e2b_code_interpreter import Sandbox as CISandbox

suite = {"suite": os.environ["SUITE"]}
out = {}
s = Sandbox.create(metadata=suite, timeout=120)
out["id"] = s.sandbox_id
out["run"] = s.commands.run("echo old-$((6*7)); id -un").stdout
s.files.write("/tmp/old/a.txt", "from an older SDK")
out["read"] = s.files.read("/tmp/old/a.txt")
out["list"] = [e.name for e in s.files.list("/tmp/old")]
h = s.commands.run("sleep 600", background=True)
out["listed"] = h.pid in [p.pid for p in s.commands.list()]
out["killed_command"] = s.commands.kill(h.pid)
s.set_timeout(300)
out["paused"] = s.pause()
out["running_while_paused"] = s.is_running()
resumed = Sandbox.connect(s.sandbox_id, timeout=120)  # POST /sandboxes/{id}/connect
out["after_resume"] = resumed.files.read("/tmp/old/a.txt")
out["listed_sandbox"] = s.sandbox_id in [i.sandbox_id for i in Sandbox.list(query=None).next_items()]
out["killed"] = Sandbox.kill(s.sandbox_id)

c = CISandbox.create(metadata=suite, timeout=120)
ex = c.run_code("x = 6 * 7\nprint('printed')\nx")
out["ci"] = {"text": ex.text, "stdout": ex.logs.stdout, "error": ex.error and ex.error.name}
bad = c.run_code("1 / 0")
out["ci_error"] = bad.error.name if bad.error else None
c.kill()
print(json.dumps(out))
