//! Shared by the ffi tests: the library directory (`libibverbs.so.1`, `librdmacm.so.1` and the vendor stubs, as an
//! application finds them through `LD_LIBRARY_PATH`), the device configuration, free ports, and
//! running a server and a client as two processes.

#![allow(dead_code)]

use std::net::{TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// `target/<profile>/softrdma-lib`, filled once per test binary.
pub fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test exe");
        // target/<profile>/deps/<test> -> target/<profile>
        let profile_dir = exe.parent().and_then(Path::parent).expect("target dir").to_path_buf();
        // Cargo builds the cdylib into deps/ for the tests (and copies it up a level only when it
        // links it anew), so deps/ has the current one.
        let built = [profile_dir.join("deps/libibverbs.so"), profile_dir.join("libibverbs.so")]
            .into_iter()
            .find(|p| p.exists())
            .expect("libibverbs.so is missing: build the softrdma-ffi crate first");
        let dir = profile_dir.join("softrdma-lib");
        std::fs::create_dir_all(&dir).expect("create softrdma-lib");
        let stubs = Path::new(env!("OUT_DIR")).join("softrdma-lib");
        let files = [
            (built, "libibverbs.so.1"),
            (stubs.join("libmlx5.so.1"), "libmlx5.so.1"),
            (stubs.join("libefa.so.1"), "libefa.so.1"),
            (stubs.join("librdmacm.so.1"), "librdmacm.so.1"),
        ];
        for (src, name) in files {
            // Copy then rename: other test binaries may be reading the directory right now.
            let tmp = dir.join(format!(".{name}.{}", std::process::id()));
            std::fs::copy(&src, &tmp).unwrap_or_else(|e| panic!("copy {}: {e}", src.display()));
            std::fs::rename(&tmp, dir.join(name)).expect("rename into softrdma-lib");
        }
        dir
    })
}

/// Where a Debian program is installed, if it is.
pub fn program(name: &str) -> Option<PathBuf> {
    ["/usr/bin", "/usr/local/bin", "/bin"].iter().map(|d| Path::new(d).join(name)).find(|p| p.exists())
}

/// The devices of these tests: `sr0` on 127.0.0.2 (servers) and `sr1` on 127.0.0.3 (clients).
pub fn devices_conf() -> &'static Path {
    static CONF: OnceLock<PathBuf> = OnceLock::new();
    CONF.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("softrdma-ffi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let conf = dir.join("devices.conf");
        std::fs::write(&conf, "# softrdma-ffi tests\nsr0 netdev lo addr 127.0.0.2\nsr1 netdev lo addr 127.0.0.3\n")
            .expect("write devices.conf");
        conf
    })
}

/// A UDP port free on every address (both devices bind it on their own address).
pub fn free_udp_port() -> u16 {
    UdpSocket::bind("0.0.0.0:0").expect("bind UDP").local_addr().expect("addr").port()
}

/// A TCP port free on every address, for the programs' out-of-band exchange.
pub fn free_tcp_port() -> u16 {
    TcpListener::bind("0.0.0.0:0").expect("bind TCP").local_addr().expect("addr").port()
}

/// Programs run one pair at a time: two busy-polling processes per pair already fill a
/// two-core machine.
pub fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|p| p.into_inner())
}

/// A command running a program against our library and devices.
pub fn command(prog: &Path, udp_port: u16) -> Command {
    let mut c = Command::new(prog);
    c.env("LD_LIBRARY_PATH", lib_dir())
        .env("SOFTRDMA_CONFIG", devices_conf())
        .env("SOFTRDMA_UDP_PORT", udp_port.to_string())
        .env("SOFTRDMA_FFI_DEBUG", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Whether something listens on TCP `port` (from /proc/net/tcp{,6}; connecting to find out would
/// use up the server's one accept).
fn listening(port: u16) -> bool {
    let hex = format!(":{port:04X} ");
    // This thread's network namespace (a test may have one of its own: `own_netns`).
    ["/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && format!("{} ", &cols[1][cols[1].len() - 5..]) == hex && cols[3] == "0A"
            })
        })
    })
}

/// Move this thread (and the programs it starts from now on) into a new network namespace with
/// its loopback up, so that what they send to a multicast group stays there. False (with a
/// message) where that cannot be done.
pub fn own_netns() -> bool {
    // SAFETY: unshare(2) with a flag; it changes only this thread's namespaces.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        eprintln!("SKIP: a network namespace of its own needs CAP_SYS_ADMIN");
        return false;
    }
    Command::new("ip").args(["link", "set", "lo", "up"]).status().is_ok_and(|s| s.success())
}

/// Wait for `child` to finish within `limit`, killing it past that.
pub fn wait_limit(mut child: Child, limit: Duration) -> (Output, bool) {
    let start = Instant::now();
    let mut killed = false;
    loop {
        match child.try_wait().expect("try_wait") {
            Some(_) => break,
            None if start.elapsed() > limit => {
                let _ = child.kill();
                killed = true;
                break;
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    (child.wait_with_output().expect("output"), killed)
}

/// What one run of a pair printed.
pub struct PairRun {
    pub server: String,
    pub client: String,
    pub server_ok: bool,
    pub client_ok: bool,
}

impl PairRun {
    pub fn describe(&self) -> String {
        format!(
            "----- server (ok={}):\n{}\n----- client (ok={}):\n{}",
            self.server_ok, self.server, self.client_ok, self.client
        )
    }
}

/// Run `prog args` as a server on `sr0` and `prog args 127.0.0.1` as a client on `sr1`, with a
/// fresh UDP and TCP port; `port_flag` is how the program takes its TCP port.
pub fn run_pair(prog: &Path, args: &[&str], port_flag: &str, limit: Duration) -> PairRun {
    let udp = free_udp_port();
    let tcp = free_tcp_port().to_string();
    let server =
        command(prog, udp).args(["-d", "sr0"]).args(args).args([port_flag, &tcp]).spawn().expect("spawn server");
    let start = Instant::now();
    while !listening(tcp.parse().unwrap()) && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let client = command(prog, udp)
        .args(["-d", "sr1"])
        .args(args)
        .args([port_flag, &tcp, "127.0.0.1"])
        .spawn()
        .expect("spawn client");
    let (c, ckilled) = wait_limit(client, limit);
    let (s, skilled) = wait_limit(server, if ckilled { Duration::from_secs(1) } else { limit });
    let text = |o: &Output| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    PairRun {
        server: text(&s),
        client: text(&c),
        server_ok: s.status.success() && !skilled,
        client_ok: c.status.success() && !ckilled,
    }
}
