// E2B's JS code interpreter SDK (npm `@e2b/code-interpreter`), unchanged, against branchboxd's E2B
// endpoint (E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY point it there): runCode, contexts, bash,
// then E2B's own `Sandbox.fork` (beyond E2B's cloud: the children carry the python context).
// Prints one JSON object of what it saw; the Python test checks it.
import { Sandbox } from '@e2b/code-interpreter'

const out = {}
const opts = { metadata: { suite: process.env.SUITE }, timeoutMs: 120_000 }
// The endpoint serves `code-interpreter-v1` from the base image until that template is built.
const sbx = await Sandbox.create(opts)
out.id = sbx.sandboxId
const first = await sbx.runCode('x = 41\nprint("hi")\nx + 1')
out.first = { text: first.text, stdout: first.logs.stdout, count: first.executionCount }
const failed = await sbx.runCode('1/0')
out.error = { name: failed.error?.name, value: failed.error?.value, traceback: failed.error?.traceback.includes('ZeroDivisionError') }
const lines = []
await sbx.runCode('import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.1)', {
  onStdout: (m) => lines.push(m.line),
})
out.streamed = lines.join('')
out.envs = (await sbx.runCode('import os; os.environ["FOO"]', { envs: { FOO: 'bar' } })).text
out.envsAfter = (await sbx.runCode('import os; os.environ.get("FOO", "unset")')).text
const ctx = await sbx.createCodeContext({ language: 'python', cwd: '/tmp' })
out.ctxLanguage = ctx.language
await sbx.runCode('y = 5', { context: ctx })
out.ctx = (await sbx.runCode('import os; (y, os.getcwd())', { context: ctx })).text
out.ctxListed = (await sbx.listCodeContexts()).some((c) => c.id === ctx.id)
await sbx.restartCodeContext(ctx)
out.afterRestart = (await sbx.runCode('y', { context: ctx })).error?.name
await sbx.removeCodeContext(ctx)
out.ctxAfterRemove = (await sbx.listCodeContexts()).some((c) => c.id === ctx.id)
out.bash = (await sbx.runCode('echo $((6*7)); id -un', { language: 'bash' })).logs.stdout.join('')
try {
  await sbx.runCode('1', { context: { id: 'no-such-context', language: 'python', cwd: '/' } })
} catch (e) {
  out.unknownContext = e.constructor.name
}
const kids = await Sandbox.fork(sbx.sandboxId, { count: 2, timeoutMs: 120_000 })
out.forked = []
for (const kid of kids) {
  if (kid instanceof Error) throw kid
  await kid.runCode('x += 100')
  out.forked.push((await kid.runCode('x')).text)
  await kid.kill()
}
out.parentAfterForks = (await sbx.runCode('x')).text
out.killed = await sbx.kill()
console.log(JSON.stringify(out))
