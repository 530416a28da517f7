//! Which soft devices exist (embedded mode): the device configuration file.
//!
//! This module owns [`DeviceConfig`] (a device's name, its netdev and optionally one bound IP
//! address), the [`Registry`] of them, the file format, where the file lives
//! ([`config_path`]) and writing it back ([`Registry::save`], for the future
//! `softrdma link add/delete`).
//!
//! # File format
//!
//! One device per line, fields separated by blanks:
//!
//! ```text
//! # NAME  netdev IFACE  [addr IP]  [roce-mode v1|v2]
//! rxe0    netdev eth0
//! rxelo   netdev lo     addr 127.0.0.2
//! rxev1   netdev eth1   roce-mode v1
//! ```
//!
//! `roce-mode` is the default RoCE mode of port 1 (what rdma_cm's configfs `default_roce_mode`
//! sets); v2 when absent.
//!
//! `#` starts a comment (to the end of the line); blank lines are ignored. Names are 1 to 63
//! characters from `A-Z a-z 0-9 _ - .` (rdma-core's limit is 64 bytes with the NUL) and unique.
//! Errors name the file and the line (`devices.conf:3: unknown keyword "adr"`).
//!
//! # Where the file is
//!
//! `$SOFTRDMA_CONFIG` if set; otherwise `/etc/softrdma/devices.conf` for root and
//! `$XDG_CONFIG_HOME/softrdma/devices.conf` (default `~/.config/softrdma/devices.conf`) for
//! everyone else. When the file does not exist there is one implicit device, `rxe0` on `lo`, so
//! that everything works with zero setup. An existing but empty file means "no devices".

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};

/// Environment variable that overrides the configuration file's path.
pub const CONFIG_ENV: &str = "SOFTRDMA_CONFIG";

/// The configuration file of root.
pub const SYSTEM_CONFIG: &str = "/etc/softrdma/devices.conf";

/// Name of the device that exists when there is no configuration file.
pub const IMPLICIT_DEVICE: &str = "rxe0";

/// Netdev of the implicit device.
pub const IMPLICIT_NETDEV: &str = "lo";

/// Longest device name (rdma-core's `IBV_SYSFS_NAME_MAX` is 64 with the NUL).
pub const MAX_NAME_LEN: usize = 63;

/// One configured device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Device name (`rxe0`).
    pub name: String,
    /// Network interface it is bound to (`eth0`).
    pub netdev: String,
    /// The one local address it uses, or `None` for all of the interface's addresses.
    pub addr: Option<IpAddr>,
}

impl DeviceConfig {
    /// A device on `netdev` using all of its addresses.
    pub fn new(name: impl Into<String>, netdev: impl Into<String>) -> DeviceConfig {
        DeviceConfig { name: name.into(), netdev: netdev.into(), addr: None }
    }

    /// The same device bound to `addr` only.
    pub fn with_addr(mut self, addr: IpAddr) -> DeviceConfig {
        self.addr = Some(addr);
        self
    }

    /// The configuration line for this device (no newline).
    pub fn to_line(&self) -> String {
        match self.addr {
            Some(a) => format!("{} netdev {} addr {}", self.name, self.netdev, a),
            None => format!("{} netdev {}", self.name, self.netdev),
        }
    }
}

/// Where a [`Registry`] came from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Source {
    /// Read from this file.
    File(PathBuf),
    /// No file existed at this path; the implicit device is used.
    Implicit(PathBuf),
    /// Built in memory.
    Memory,
}

/// Errors of the registry.
#[derive(Debug)]
#[non_exhaustive]
pub enum RegistryError {
    /// The file could not be read or written.
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        error: io::Error,
    },
    /// A line of the file is malformed.
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// Two devices with one name.
    Duplicate(String),
    /// A device name that is not allowed.
    BadName(String),
    /// No device with this name.
    UnknownDevice(String),
}

impl fmt::Display for RegistryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegistryError::Io { path, error } => write!(f, "{}: {error}", path.display()),
            RegistryError::Parse { path, line, message } => write!(f, "{}:{line}: {message}", path.display()),
            RegistryError::Duplicate(n) => write!(f, "device {n:?} is defined twice"),
            RegistryError::BadName(n) => {
                write!(f, "invalid device name {n:?}: use 1 to {MAX_NAME_LEN} characters from A-Z a-z 0-9 _ - .")
            }
            RegistryError::UnknownDevice(n) => write!(f, "IB device '{n}' wasn't found"),
        }
    }
}

impl std::error::Error for RegistryError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RegistryError::Io { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// Checks a device name (see the module docs).
pub fn check_name(name: &str) -> Result<(), RegistryError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        && name != "."
        && name != "..";
    if ok {
        Ok(())
    } else {
        Err(RegistryError::BadName(name.to_owned()))
    }
}

/// The configured devices, in file order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registry {
    devices: Vec<DeviceConfig>,
    source: Source,
    /// Devices whose default RoCE mode is v1.
    roce_v1: BTreeSet<String>,
}

impl Registry {
    /// An empty registry (no devices).
    pub fn empty() -> Registry {
        Registry { devices: Vec::new(), source: Source::Memory, roce_v1: BTreeSet::new() }
    }

    /// The registry used when no file exists: `rxe0` on `lo`.
    pub fn implicit() -> Registry {
        Registry {
            devices: vec![DeviceConfig::new(IMPLICIT_DEVICE, IMPLICIT_NETDEV)],
            source: Source::Memory,
            roce_v1: BTreeSet::new(),
        }
    }

    /// Loads the registry from [`config_path`].
    pub fn load() -> Result<Registry, RegistryError> {
        Registry::load_from(&config_path())
    }

    /// Loads the registry from `path`; a missing file gives [`Registry::implicit`].
    pub fn load_from(path: &Path) -> Result<Registry, RegistryError> {
        match fs::read_to_string(path) {
            Ok(text) => {
                let mut r = Registry::parse(&text, path)?;
                r.source = Source::File(path.to_owned());
                Ok(r)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let mut r = Registry::implicit();
                r.source = Source::Implicit(path.to_owned());
                Ok(r)
            }
            Err(error) => Err(RegistryError::Io { path: path.to_owned(), error }),
        }
    }

    /// Parses the file format; `path` is only used in error messages.
    pub fn parse(text: &str, path: &Path) -> Result<Registry, RegistryError> {
        let mut reg = Registry::empty();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let err = |message: String| RegistryError::Parse { path: path.to_owned(), line, message };
            let content = raw.split('#').next().unwrap_or("");
            let mut words = content.split_whitespace();
            let Some(name) = words.next() else {
                continue;
            };
            check_name(name).map_err(|e| err(e.to_string()))?;
            let mut netdev = None;
            let mut addr = None;
            let mut roce = None;
            while let Some(key) = words.next() {
                let value = words.next().ok_or_else(|| err(format!("{key:?} needs a value")))?;
                match key {
                    "netdev" if netdev.is_none() => {
                        if value.len() > 15 || value.contains('/') {
                            return Err(err(format!("invalid interface name {value:?}")));
                        }
                        netdev = Some(value.to_owned());
                    }
                    "addr" if addr.is_none() => {
                        let ip = value.parse::<IpAddr>().map_err(|_| err(format!("invalid IP address {value:?}")))?;
                        addr = Some(ip);
                    }
                    "roce-mode" if roce.is_none() => match value {
                        "v1" => roce = Some(true),
                        "v2" => roce = Some(false),
                        _ => return Err(err(format!("invalid RoCE mode {value:?} (v1 or v2)"))),
                    },
                    "netdev" | "addr" | "roce-mode" => return Err(err(format!("{key:?} given twice"))),
                    other => return Err(err(format!("unknown keyword {other:?} (expected \"netdev\" or \"addr\")"))),
                }
            }
            let netdev = netdev.ok_or_else(|| err(format!("device {name:?} has no \"netdev IFACE\"")))?;
            let dev = DeviceConfig { name: name.to_owned(), netdev, addr };
            reg.add(dev).map_err(|e| err(e.to_string()))?;
            if roce == Some(true) {
                reg.roce_v1.insert(name.to_owned());
            }
        }
        Ok(reg)
    }

    /// Where this registry came from.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The devices, in order.
    pub fn devices(&self) -> &[DeviceConfig] {
        &self.devices
    }

    /// The device named `name`.
    pub fn find(&self, name: &str) -> Result<&DeviceConfig, RegistryError> {
        self.devices.iter().find(|d| d.name == name).ok_or_else(|| RegistryError::UnknownDevice(name.to_owned()))
    }

    /// Adds a device; its name must be valid and new.
    pub fn add(&mut self, dev: DeviceConfig) -> Result<(), RegistryError> {
        check_name(&dev.name)?;
        if self.devices.iter().any(|d| d.name == dev.name) {
            return Err(RegistryError::Duplicate(dev.name));
        }
        self.devices.push(dev);
        Ok(())
    }

    /// Removes the device named `name`.
    pub fn remove(&mut self, name: &str) -> Result<DeviceConfig, RegistryError> {
        let pos = self
            .devices
            .iter()
            .position(|d| d.name == name)
            .ok_or_else(|| RegistryError::UnknownDevice(name.to_owned()))?;
        self.roce_v1.remove(name);
        Ok(self.devices.remove(pos))
    }

    /// Renames a device, keeping its place and settings (`rdma dev set NAME name NEWNAME`).
    pub fn rename(&mut self, name: &str, new_name: &str) -> Result<(), RegistryError> {
        check_name(new_name)?;
        if name != new_name && self.devices.iter().any(|d| d.name == new_name) {
            return Err(RegistryError::Duplicate(new_name.to_owned()));
        }
        let dev = self
            .devices
            .iter_mut()
            .find(|d| d.name == name)
            .ok_or_else(|| RegistryError::UnknownDevice(name.to_owned()))?;
        dev.name = new_name.to_owned();
        if self.roce_v1.remove(name) {
            self.roce_v1.insert(new_name.to_owned());
        }
        Ok(())
    }

    /// Whether the default RoCE mode of `name`'s port 1 is v1 (otherwise v2).
    pub fn roce_v1(&self, name: &str) -> bool {
        self.roce_v1.contains(name)
    }

    /// Sets the default RoCE mode of `name`'s port 1: v1 if `v1`, else v2.
    pub fn set_roce_v1(&mut self, name: &str, v1: bool) -> Result<(), RegistryError> {
        self.find(name)?;
        if v1 {
            self.roce_v1.insert(name.to_owned());
        } else {
            self.roce_v1.remove(name);
        }
        Ok(())
    }

    /// The file text for this registry.
    pub fn to_config_string(&self) -> String {
        let mut s = String::from("# softrdma devices: NAME netdev IFACE [addr IP] [roce-mode v1|v2]\n");
        for d in &self.devices {
            s.push_str(&d.to_line());
            if self.roce_v1.contains(&d.name) {
                s.push_str(" roce-mode v1");
            }
            s.push('\n');
        }
        s
    }

    /// Writes the registry to `path` atomically (a temporary file in the same directory, then
    /// rename), creating the directory if needed.
    pub fn save(&self, path: &Path) -> Result<(), RegistryError> {
        let io_err = |error| RegistryError::Io { path: path.to_owned(), error };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&dir).map_err(io_err)?;
        let mut tmp_name = path.file_name().map(OsString::from).unwrap_or_default();
        tmp_name.push(format!(".tmp{}", std::process::id()));
        let tmp = dir.join(tmp_name);
        let write = || -> io::Result<()> {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(self.to_config_string().as_bytes())?;
            f.sync_all()?;
            fs::rename(&tmp, path)
        };
        write().map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_err(e)
        })
    }
}

/// The configuration file path for this process (see the module docs).
pub fn config_path() -> PathBuf {
    config_path_with(|k| std::env::var_os(k), nix::unistd::geteuid().is_root())
}

/// [`config_path`] with the environment and the root test supplied by the caller.
pub fn config_path_with(env: impl Fn(&str) -> Option<OsString>, is_root: bool) -> PathBuf {
    let nonempty = |k: &str| env(k).filter(|v| !v.is_empty());
    if let Some(p) = nonempty(CONFIG_ENV) {
        return PathBuf::from(p);
    }
    if is_root {
        return PathBuf::from(SYSTEM_CONFIG);
    }
    let base = match nonempty("XDG_CONFIG_HOME") {
        Some(x) => PathBuf::from(x),
        None => match nonempty("HOME") {
            Some(h) => PathBuf::from(h).join(".config"),
            None => PathBuf::from(".config"),
        },
    };
    base.join("softrdma").join("devices.conf")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Registry, RegistryError> {
        Registry::parse(text, Path::new("devices.conf"))
    }

    #[test]
    fn parses_devices_comments_and_blanks() {
        let r = parse(
            "# comment\n\nrxe0 netdev eth0\n  rxelo netdev lo addr 127.0.0.2  # trailing\nv6 addr ::1 netdev lo\n",
        )
        .unwrap();
        assert_eq!(
            r.devices(),
            [
                DeviceConfig::new("rxe0", "eth0"),
                DeviceConfig::new("rxelo", "lo").with_addr("127.0.0.2".parse().unwrap()),
                DeviceConfig::new("v6", "lo").with_addr("::1".parse().unwrap()),
            ]
        );
        assert_eq!(r.find("rxelo").unwrap().netdev, "lo");
        assert_eq!(r.find("nosuch").unwrap_err().to_string(), "IB device 'nosuch' wasn't found");
        assert!(parse("").unwrap().devices().is_empty());
    }

    #[test]
    fn parse_errors_name_the_line() {
        for (text, want) in [
            ("rxe0\n", "devices.conf:1: device \"rxe0\" has no \"netdev IFACE\""),
            ("\nrxe0 netdev\n", "devices.conf:2: \"netdev\" needs a value"),
            ("rxe0 netdev lo adr 1.2.3.4", "devices.conf:1: unknown keyword \"adr\" (expected \"netdev\" or \"addr\")"),
            ("rxe0 netdev lo addr 1.2.3", "devices.conf:1: invalid IP address \"1.2.3\""),
            ("rxe0 netdev lo netdev eth0", "devices.conf:1: \"netdev\" given twice"),
            ("a netdev lo\n# x\na netdev eth0", "devices.conf:3: device \"a\" is defined twice"),
            (
                "rx/e netdev lo",
                "devices.conf:1: invalid device name \"rx/e\": use 1 to 63 characters from A-Z a-z 0-9 _ - .",
            ),
            ("rxe netdev ../../x", "devices.conf:1: invalid interface name \"../../x\""),
        ] {
            assert_eq!(parse(text).unwrap_err().to_string(), want, "{text:?}");
        }
        assert!(check_name(&"a".repeat(63)).is_ok());
        assert!(check_name(&"a".repeat(64)).is_err());
        assert!(check_name("..").is_err());
    }

    #[test]
    fn add_remove_and_round_trip() {
        let mut r = Registry::implicit();
        assert_eq!(r.devices(), [DeviceConfig::new("rxe0", "lo")]);
        r.add(DeviceConfig::new("rxe1", "lo").with_addr("127.0.0.2".parse().unwrap())).unwrap();
        assert!(matches!(r.add(DeviceConfig::new("rxe1", "eth0")), Err(RegistryError::Duplicate(_))));
        let text = r.to_config_string();
        assert_eq!(parse(&text).unwrap().devices(), r.devices());
        assert_eq!(r.remove("rxe0").unwrap().name, "rxe0");
        assert!(r.remove("rxe0").is_err());
    }

    #[test]
    fn rename_and_roce_mode_round_trip() {
        let mut r = parse("a netdev lo roce-mode v1\nb netdev lo roce-mode v2\n").unwrap();
        assert!(r.roce_v1("a") && !r.roce_v1("b"));
        r.rename("a", "c").unwrap();
        assert!(r.roce_v1("c") && !r.roce_v1("a"));
        assert!(matches!(r.rename("c", "b"), Err(RegistryError::Duplicate(_))));
        assert!(matches!(r.rename("zz", "y"), Err(RegistryError::UnknownDevice(_))));
        r.set_roce_v1("b", true).unwrap();
        let back = parse(&r.to_config_string()).unwrap();
        assert_eq!(back.devices()[0].name, "c");
        assert!(back.roce_v1("c") && back.roce_v1("b"));
        assert!(parse("a netdev lo roce-mode v3").is_err());
    }

    #[test]
    fn load_save_and_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/devices.conf");
        let r = Registry::load_from(&path).unwrap();
        assert_eq!(r.devices(), Registry::implicit().devices());
        assert_eq!(r.source(), &Source::Implicit(path.clone()));

        let mut r = Registry::empty();
        r.add(DeviceConfig::new("a", "lo")).unwrap();
        r.save(&path).unwrap();
        let back = Registry::load_from(&path).unwrap();
        assert_eq!(back.devices(), r.devices());
        assert_eq!(back.source(), &Source::File(path.clone()));
        // No temporary file left behind.
        assert_eq!(fs::read_dir(path.parent().unwrap()).unwrap().count(), 1);

        fs::write(&path, "a netdev lo\nb netdev\n").unwrap();
        let e = Registry::load_from(&path).unwrap_err().to_string();
        assert!(e.ends_with("devices.conf:2: \"netdev\" needs a value"), "{e}");
        // A directory where the file should be is an I/O error, not "no devices".
        assert!(matches!(Registry::load_from(dir.path()), Err(RegistryError::Io { .. })));
    }

    #[test]
    fn config_path_rules() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v))
        };
        assert_eq!(config_path_with(env(&[("SOFTRDMA_CONFIG", "/tmp/x.conf")]), true), PathBuf::from("/tmp/x.conf"));
        assert_eq!(config_path_with(env(&[("HOME", "/home/u")]), true), PathBuf::from("/etc/softrdma/devices.conf"));
        assert_eq!(
            config_path_with(env(&[("HOME", "/home/u")]), false),
            PathBuf::from("/home/u/.config/softrdma/devices.conf")
        );
        assert_eq!(
            config_path_with(env(&[("HOME", "/home/u"), ("XDG_CONFIG_HOME", "/xdg")]), false),
            PathBuf::from("/xdg/softrdma/devices.conf")
        );
        assert_eq!(
            config_path_with(env(&[("SOFTRDMA_CONFIG", "")]), true),
            PathBuf::from("/etc/softrdma/devices.conf")
        );
    }
}
