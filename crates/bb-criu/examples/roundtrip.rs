//! Manual check: dump a process tree of a running sandbox and restore it in place.
//! `roundtrip INIT_PID ROOT_HOST_PID ROOT_NS_PID DIR CGROUP_PROCS...` (`LAZY=1`: a lazy restore)
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let criu =
        bb_criu::Criu::find("/usr/local/lib/branchbox/criu".as_ref(), "target/release/branchbox-criu-exec".as_ref())
            .unwrap();
    let sb = bb_criu::SandboxRef {
        init_pid: a[1].parse().unwrap(),
        cgroup_procs: a[5..].iter().map(Into::into).collect(),
        host_dir: None,
    };
    let root = bb_criu::Root { host_pid: a[2].parse().unwrap(), ns_pid: a[3].parse().unwrap() };
    let t = std::time::Instant::now();
    let m = criu.dump(
        &sb,
        root,
        a[4].as_ref(),
        &bb_criu::DumpOptions { leave_running: false, kind: "test".into(), ..Default::default() },
    );
    println!("dump {:?} {:?}", t.elapsed(), m.as_ref().map(|m| (m.bytes, m.externals.len())));
    m.unwrap();
    let t = std::time::Instant::now();
    let r = criu.restore(&sb, a[4].as_ref(), std::env::var_os("LAZY").is_some(), &[], None);
    println!("restore {:?} {:?}", t.elapsed(), r.as_ref().map(|r| &r.manifest.tasks));
    if let Some(server) = r.ok().and_then(|r| r.lazy) {
        println!("lazy pages {:?} after {:?}", server.wait(std::time::Duration::from_secs(60)), server.took());
    }
}
