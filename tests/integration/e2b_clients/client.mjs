// E2B's JS SDK, unchanged, against branchboxd's E2B endpoint (E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY point it there; E2B_VOLUME_API_URL for volumes). Prints one JSON object of what it
// saw; the Python test checks it.
import { Sandbox, CommandExitError, Volume, VolumeFileType, VolumePathNotFoundError } from 'e2b'

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

// Volumes: the control plane, the content API, and a sandbox mounting one.
const vol = await Volume.create('jsvol-' + process.env.SUITE)
out.volumeId = vol.volumeId
await vol.makeDir('/d')
const written = await vol.writeFile('/d/f.txt', 'vol from js')
out.volumeWritten = { type: written.type === VolumeFileType.FILE, mode: written.mode & 0o777, uid: written.uid }
out.volumeRead = await vol.readFile('/d/f.txt')
out.volumeList = (await vol.list('/')).map((e) => e.path)
out.volumeExists = [await vol.exists('/d/f.txt'), await vol.exists('/nope')]
try {
  await vol.getInfo('/nope')
} catch (e) {
  out.volumeMissing = e instanceof VolumePathNotFoundError
}
out.volumeListed = (await Volume.list()).some((v) => v.volumeId === vol.volumeId)
const withVol = await Sandbox.create({ metadata: { suite: process.env.SUITE }, volumeMounts: { '/mnt/v': vol } })
out.volumeInSandbox = (await withVol.commands.run('cat /mnt/v/d/f.txt; echo more > /mnt/v/d/g.txt')).stdout
await withVol.kill()
out.volumeFromSandbox = await vol.readFile('/d/g.txt')
await vol.remove('/d')
out.volumeAfterRemove = await vol.exists('/d')
out.volumeDestroyed = await Volume.destroy(vol.volumeId)
console.log(JSON.stringify(out))
