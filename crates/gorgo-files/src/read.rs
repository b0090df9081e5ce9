//! Reads of operator-named files with a size cap.

use std::path::Path;

/// The text of the file at `path`, refused when it holds more than `cap` bytes.
///
/// Why: the files a node or the emulator reads at startup are named by an operator, and
/// a wrong path (`/dev/zero`, a device) would grow memory without end; its
/// `metadata().len()` says 0, so only a read through `take(cap + 1)` stops it. The error says what is wrong, not which file: callers name it.
pub fn read_capped(path: &Path, cap: u64) -> std::io::Result<String> {
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
    String::from_utf8(bytes)
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
}
