//! One module per subcommand; each owns its arguments and its driver.
pub mod bench;
pub mod certs;
pub mod engine;
pub mod netem;
pub mod node;
pub mod sim;
pub mod sweep;
pub mod topology;
pub mod trace;
pub mod tune_offline;
pub mod up;

use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer as _;

/// A layer of the process' subscriber beside its log lines (the node's OpenTelemetry
/// layer).
pub type ExtraLayer =
    Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

/// Initialise `tracing` once for a long-running subcommand (`RUST_LOG` filters).
pub fn init_tracing() {
    init_tracing_with(None);
}

/// [`init_tracing`] with one more layer, which filters for itself: `RUST_LOG` filters
/// the log lines only.
pub fn init_tracing_with(extra: Option<ExtraLayer>) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::registry()
        .with(extra)
        .with(tracing_subscriber::fmt::layer().with_filter(filter))
        .try_init();
}

/// A file written whole or not at all: the bytes go to a temporary file beside it,
/// which [`AtomicFile::commit`] renames over it. A reader (`gorgo down` reading
/// `pids.json`) never finds it half written, a write that fails or is interrupted
/// leaves the old file as it was, and an output that is also the input (`gorgo trace
/// convert F --out F`) is read whole before it is replaced. Where `path` is a
/// symbolic link, the file it points to is replaced.
#[derive(Debug)]
pub struct AtomicFile {
    /// The file to replace.
    path: std::path::PathBuf,
    /// The temporary file beside it; removed on drop unless committed.
    tmp: std::path::PathBuf,
    file: Option<std::io::BufWriter<std::fs::File>>,
}

impl AtomicFile {
    /// Start writing `path` (its directory must exist).
    pub fn create(path: &std::path::Path) -> std::io::Result<Self> {
        use std::sync::atomic::{AtomicU64, Ordering};
        // Two files of one process never share a temporary name.
        static NEXT: AtomicU64 = AtomicU64::new(0);
        // Through a link to the file it names: renaming over the link would replace
        // the link, and leave its target as it was.
        let path = match std::fs::canonicalize(path) {
            Ok(p) => p,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => path.to_path_buf(),
            Err(e) => return Err(e),
        };
        let name = path.file_name().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name")
        })?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(
            ".{}.{}.tmp",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let tmp = path.with_file_name(tmp_name);
        let file = std::fs::File::create(&tmp)?;
        Ok(AtomicFile {
            path,
            tmp,
            file: Some(std::io::BufWriter::new(file)),
        })
    }

    /// Flush, and put the file in place of the old one.
    pub fn commit(mut self) -> std::io::Result<()> {
        use std::io::Write as _;
        let mut file = self.file.take().expect("taken only here");
        file.flush()?;
        file.get_ref().sync_all()?;
        drop(file);
        std::fs::rename(&self.tmp, &self.path)
    }
}

impl std::io::Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.as_mut().expect("open until commit").write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.as_mut().expect("open until commit").flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        // Not committed (an error on the way): the old file stays; no debris beside it.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

/// Write `bytes` to `path` as an [`AtomicFile`].
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut f = AtomicFile::create(path)?;
    f.write_all(bytes)?;
    f.commit()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that opened the old file reads it whole after the write (a truncating
    /// write would have emptied it under the reader); the new content is in place, no
    /// temporary file is left, and a write through a link replaces its target.
    #[test]
    fn an_atomic_write_replaces_the_file_and_never_truncates_it() {
        use std::io::Read as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pids.json");
        std::fs::write(&path, "old and whole").unwrap();
        let mut reader = std::fs::File::open(&path).unwrap();
        write_atomic(&path, b"new").unwrap();
        let mut old = String::new();
        reader.read_to_string(&mut old).unwrap();
        assert_eq!(old, "old and whole");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "{names:?}");

        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        write_atomic(&link, b"through the link").unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "through the link");

        // Dropped without a commit: the old file stays, and nothing is left beside it.
        let mut f = AtomicFile::create(&path).unwrap();
        std::io::Write::write_all(&mut f, b"half").unwrap();
        drop(f);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "through the link");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }
}
