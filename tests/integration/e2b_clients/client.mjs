// E2B's JS SDK, unchanged, against branchboxd's E2B endpoint (E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY point it there). Prints one JSON object of what it saw; the Python test checks it.
import { Sandbox, CommandExitError } from 'e2b'

const out = {}
const sbx = await Sandbox.create({ metadata: { suite: process.env.SUITE }, timeoutMs: 120_000 })
out.id = sbx.sandboxId
out.run = (await sbx.commands.run('echo hello-$((6*7)); id -un')).stdout
const chunks = []
await sbx.commands.run('for i in 1 2 3; do echo line-$i; done', { onStdout: (d) => chunks.push(d) })
out.streamed = chunks.join('')
try {
  await sbx.commands.run('echo oops >&2; exit 7')
} catch (e) {
  out.exit = { isExitError: e instanceof CommandExitError, code: e.exitCode, stderr: e.stderr }
}
const bg = await sbx.commands.run('sleep 600', { background: true })
out.listed = (await sbx.commands.list()).some((p) => p.pid === bg.pid)
out.killedCommand = await bg.kill()
await sbx.files.write('/tmp/js/a.txt', 'from js')
out.read = await sbx.files.read('/tmp/js/a.txt')
out.cat = (await sbx.commands.run('cat /tmp/js/a.txt')).stdout
out.list = (await sbx.files.list('/tmp/js')).map((e) => e.name)
out.exists = [await sbx.files.exists('/tmp/js/a.txt'), await sbx.files.exists('/tmp/js/nope')]
await sbx.files.rename('/tmp/js/a.txt', '/tmp/js/b.txt')
await sbx.files.remove('/tmp/js/b.txt')
out.afterRemove = (await sbx.files.list('/tmp/js')).length
out.state = (await sbx.getInfo()).state
out.listedSandbox = (await Sandbox.list({ query: { metadata: { suite: process.env.SUITE } } }).nextItems())
  .some((i) => i.sandboxId === sbx.sandboxId)
out.killed = await sbx.kill()
out.runningAfterKill = await sbx.isRunning()
console.log(JSON.stringify(out))
