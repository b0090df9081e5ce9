//! Files replaced whole or not at all: each is written to a temporary file beside its
//! destination, then renamed over it (a rename within one directory is atomic), so a
//! reader never finds one half written and a failed or killed write leaves the old one
//! whole. The one such helper of the workspace: reports, sweeps and the node's
//! learned-weights file all go through it.

use std::ffi::OsString;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A file written to a temporary path beside its destination and not yet in place:
/// [`Staged::commit`] renames it over the destination. Dropped uncommitted (an error
/// staging or committing another file of the same report), it removes its temporary
/// file, so the destination keeps its old content and no stray file is left.
#[derive(Debug)]
#[must_use = "a staged file is removed unless committed"]
pub struct Staged {
    tmp: PathBuf,
    path: PathBuf,
    committed: bool,
}

/// Write `contents` to a temporary file beside `path` (flushed to disk) without
/// touching `path`: the first half of [`write_atomic`], for writers of several files
/// that stage them all before replacing any.
pub fn stage(path: &Path, contents: &[u8]) -> io::Result<Staged> {
    // Two writes in one process (two in-process nodes, two reports) never share a
    // temporary file; the process id keeps concurrent processes apart.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: not a file name", path.display()),
        )
    })?;
    // A dot file, so a listing or a glob of the directory does not pick it up.
    let mut tmp_name = OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(
        ".{}.{}.tmp",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let staged = Staged {
        tmp: path.with_file_name(tmp_name),
        path: path.to_path_buf(),
        committed: false,
    };
    let mut f = std::fs::File::create(&staged.tmp)?;
    f.write_all(contents)?;
    f.sync_all()?;
    Ok(staged)
}

impl Staged {
    /// The destination this file replaces.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Rename the temporary file over the destination.
    pub fn commit(mut self) -> io::Result<()> {
        std::fs::rename(&self.tmp, &self.path)?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: the write already failed, and that error is the one to report.
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Replace `path` with `contents` atomically: a reader sees the old file or the new
/// one, never a part, and a failed write leaves the old one.
pub fn write_atomic(path: &Path, contents: &[u8]) -> io::Result<()> {
    stage(path, contents)?.commit()
}

/// Remove `path` if it exists: a file an earlier run wrote that this one does not
/// produce, which would otherwise sit beside the new files as if it belonged to them.
pub fn remove_stale(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_commit_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.json");
        write_atomic(&path, b"old").unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        // A directory in the way: the rename fails and the temporary file goes.
        let blocked = dir.path().join("b.svg");
        std::fs::create_dir(&blocked).unwrap();
        assert!(write_atomic(&blocked, b"x").is_err());
        // Staged, never committed: the destination is untouched.
        drop(stage(&path, b"dropped").unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }
}
