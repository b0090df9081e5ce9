//! Reads of operator-named files with a size cap.

use std::path::Path;

/// Cap for the TOML and JSON files an operator names or points a flag at (engine
/// profiles, topologies, node and generator configs, `cluster.json`, `pids.json`), bytes.
///
/// Why: one generous cap for every such file, so that `/dev/zero` or a wrong multi-GB
/// path is refused instead of filling memory; real ones are a few KiB.
pub const MAX_CONFIG_FILE_BYTES: u64 = 16 << 20;

/// The bytes of the file at `path`, refused when it holds more than `cap` bytes.
///
/// Why: the files a node or the emulator reads at startup are named by an operator, and
/// a wrong path (`/dev/zero`, a device, a FIFO fed without end) would grow memory
/// without end; its `metadata().len()` says 0, so only a read through `take(cap + 1)`
/// stops it. The error says what is wrong, not which file: callers name it.
pub fn read_capped_bytes(path: &Path, cap: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(cap.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {cap} bytes"),
        ));
    }
    Ok(bytes)
}

/// The text of the file at `path`, refused when it holds more than `cap` bytes or is
/// not UTF-8 ([`read_capped_bytes`]).
///
/// Why: most capped files are TOML, JSON or templates, parsed as text.
pub fn read_capped(path: &Path, cap: u64) -> std::io::Result<String> {
    String::from_utf8(read_capped_bytes(path, cap)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_file_is_refused_and_a_small_one_read() {
        let e = read_capped(Path::new("/dev/zero"), 1024).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.txt");
        std::fs::write(&p, "hello").unwrap();
        assert_eq!(read_capped(&p, 5).unwrap(), "hello");
        assert!(read_capped(&p, 4).is_err());
    }

    #[test]
    fn bytes_are_read_whole_up_to_the_cap_and_refused_one_byte_over() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        std::fs::write(&p, [0xff, 0, 1]).unwrap();
        assert_eq!(read_capped_bytes(&p, 3).unwrap(), [0xff, 0, 1]);
        let e = read_capped_bytes(&p, 2).unwrap_err();
        assert_eq!(e.to_string(), "larger than 2 bytes");
        // Not UTF-8: refused as text only.
        assert_eq!(
            read_capped(&p, 3).unwrap_err().kind(),
            std::io::ErrorKind::InvalidData
        );
    }

    /// A FIFO fed without end (`--config <(yes)`) ends with the cap's error: the
    /// writer stops when the reader, past the cap, closes its end.
    #[cfg(unix)]
    #[test]
    fn an_endless_fifo_is_refused() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("skipping: no mkfifo");
            return;
        }
        let path = fifo.clone();
        let writer = std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            let chunk = [b'x'; 4096];
            // Until the reader closes its end: EPIPE (SIGPIPE is ignored in Rust).
            while f.write_all(&chunk).is_ok() {}
        });
        let e = read_capped_bytes(&fifo, 1 << 20).unwrap_err();
        assert_eq!(e.to_string(), format!("larger than {} bytes", 1 << 20));
        writer.join().unwrap();
    }
}
