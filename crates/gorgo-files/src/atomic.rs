//! Files replaced whole or not at all: each is written to a temporary file beside its
//! destination, then renamed over it (a rename within one directory is atomic), so a
//! reader never finds one half written and a failed or killed write leaves the old one
//! whole. The one such helper of the workspace: reports, sweeps and the node's
//! learned-weights file all go through it.

use std::ffi::OsString;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A file being written to a temporary path beside its destination: written through
/// [`Write`] (a large output streams, it is not held in memory), then
/// [`AtomicFile::commit`] renames it over the destination. Dropped uncommitted (an
/// error on the way, or another file of the same report failing), it removes its
/// temporary file, so the destination keeps its old content and no stray file is left.
/// An output that is also the input (`gorgo trace convert F --out F`) is thus read
/// whole before it is replaced. Where the destination is a symbolic link, the file it
/// points to is replaced, not the link, as `cp` and a shell's `>` do: the link is how
/// its owner points a tool at the real file (a config kept elsewhere), and replacing
/// it would leave that file stale and the link silently turned into a copy.
///
/// Committed, the replacement survives a power loss: the temporary file is synced
/// before the rename and the directory after it. A destination that is not a regular
/// file, or that names an open descriptor, is written directly instead
/// ([`AtomicFile::create`]); a directory is refused.
#[derive(Debug)]
#[must_use = "an atomic file is removed unless committed"]
pub struct AtomicFile {
    tmp: PathBuf,
    path: PathBuf,
    /// Open until [`AtomicFile::finish`].
    file: Option<BufWriter<std::fs::File>>,
    committed: bool,
    /// Written straight into a destination that is not a regular file (`tmp` is the
    /// destination): nothing to rename or remove.
    in_place: bool,
}

impl AtomicFile {
    /// Start writing `path` (its directory must exist). Some destinations are written
    /// directly, with no temporary file and no rename, as `cat > path` would:
    /// - one that exists and is not a regular file (`/dev/null`, a FIFO, a terminal):
    ///   renaming over it would replace the device or pipe with a file, and it has no
    ///   old content to keep whole;
    /// - one that names an open descriptor of this process (`/dev/stdout`, `/dev/fd/N`,
    ///   `/proc/self/fd/N`, or a link to one): the user asked for the bytes on that
    ///   descriptor. A pipe there has no path a rename could reach, and a file there
    ///   (`>> log`) is appended to, where a replacement would drop what it held and
    ///   leave the descriptor on the unlinked old file.
    ///
    /// A directory, or a path ending in `/`, is refused with an error naming it
    /// ([`io::ErrorKind::IsADirectory`]).
    pub fn create(path: &Path) -> io::Result<Self> {
        // Two writes in one process (two in-process nodes, two reports) never share a
        // temporary file; the process id keeps concurrent processes apart.
        static NEXT: AtomicU64 = AtomicU64::new(0);
        if path.as_os_str().as_encoded_bytes().last() == Some(&b'/') {
            return Err(is_a_directory(path));
        }
        // Asked of the kernel, which follows `/dev/stdout` to what the descriptor is
        // (a pipe's `pipe:[N]` is no path that `resolve_links` could follow).
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.is_dir() {
                return Err(is_a_directory(path));
            }
            if !meta.is_file() {
                return Self::in_place(path, false);
            }
            if names_a_descriptor(path) {
                return Self::in_place(path, true);
            }
        }
        // Through a link to the file it names: renaming over the link would replace
        // the link and leave its target as it was (a dangling link too: its target is
        // created).
        let path = resolve_links(path)?;
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
        let tmp = path.with_file_name(tmp_name);
        let file = std::fs::File::create(&tmp)?;
        // The replacement keeps the file's mode: created anew it took the default, and
        // a file made 0600 (or read-only to others) came back readable by all.
        if let Ok(old) = std::fs::metadata(&path) {
            file.set_permissions(old.permissions())?;
        }
        Ok(AtomicFile {
            tmp,
            path,
            file: Some(BufWriter::new(file)),
            committed: false,
            in_place: false,
        })
    }

    /// Write straight into `path` (see [`AtomicFile::create`]), appending where it is
    /// a regular file reached through a descriptor (appending to a pipe or a device
    /// means nothing, and a block device would refuse a write past its end).
    fn in_place(path: &Path, append: bool) -> io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .append(append)
            .open(path)?;
        Ok(AtomicFile {
            tmp: path.to_path_buf(),
            path: path.to_path_buf(),
            file: Some(BufWriter::new(file)),
            committed: false,
            in_place: true,
        })
    }

    /// The destination this file replaces.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Flush the temporary file to disk and close it (once; a no-op after).
    fn finish(&mut self) -> io::Result<()> {
        if let Some(mut file) = self.file.take() {
            file.flush()?;
            if !self.in_place {
                // A pipe or a device has nothing to sync (and some refuse it).
                file.get_ref().sync_all()?;
            }
        }
        Ok(())
    }

    /// Put the file in place of the old one.
    pub fn commit(mut self) -> io::Result<()> {
        self.finish()?;
        if self.in_place {
            self.committed = true;
            return Ok(());
        }
        std::fs::rename(&self.tmp, &self.path)?;
        self.committed = true;
        sync_dir(&self.path)
    }

    fn open(&mut self) -> io::Result<&mut BufWriter<std::fs::File>> {
        self.file
            .as_mut()
            .ok_or_else(|| io::Error::other("written after it was finished"))
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.open()?.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.open()?.flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed && !self.in_place {
            // Best effort: the write already failed, and that error is the one to report.
            drop(self.file.take());
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Flush the directory holding `path` to disk: the rename is an entry of the
/// directory, and until that is on disk a crash can bring back the old file (or none,
/// for a new one) although its content was synced. A no-op where directories cannot
/// be opened as files (not Unix).
fn sync_dir(path: &Path) -> io::Result<()> {
    if !cfg!(unix) {
        return Ok(());
    }
    let dir = parent_dir(path);
    #[cfg(test)]
    tests::SYNCED_DIRS.with(|d| d.borrow_mut().push(dir.to_path_buf()));
    std::fs::File::open(dir)?.sync_all()
}

/// The directory holding `path`: `.` for a bare file name, whose parent is empty.
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// The error for a destination that is a directory: nothing can be written there, and
/// the OS's own error ("Is a directory") would not say which path.
fn is_a_directory(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::IsADirectory,
        format!("{}: is a directory, not a file to write", path.display()),
    )
}

/// The longest chain of symbolic links followed, as the kernel's (40), so a loop is
/// an error and not a hang.
const MAX_LINKS: usize = 40;

/// Whether `path`, or a link on the way from it, names an open descriptor of this
/// process (`/dev/stdout`, `/dev/fd/N`, `/proc/self/fd/N`): a descriptor directory
/// holds it. Asked of the directory, since the descriptor's own link names what it is
/// open on (a file, `pipe:[N]`), not the descriptor.
fn names_a_descriptor(path: &Path) -> bool {
    let mut path = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        let dir = parent_dir(&path).to_path_buf();
        match std::fs::canonicalize(&dir) {
            // Linux: `/proc/<pid>/fd` or `/proc/<pid>/task/<tid>/fd` (where
            // `/proc/self/fd` and `/dev/fd` lead); BSDs and macOS: `/dev/fd`.
            Ok(d) if d == Path::new("/dev/fd") => return true,
            Ok(d) if d.starts_with("/proc") && d.file_name() == Some("fd".as_ref()) => return true,
            _ => {}
        }
        match std::fs::read_link(&path) {
            // Relative to the link's directory; `join` keeps an absolute target whole.
            Ok(target) => path = dir.join(target),
            Err(_) => return false,
        }
    }
    false
}

/// `path` with every symbolic link followed, a dangling last link to the path it
/// names: what a write through the link must replace.
fn resolve_links(path: &Path) -> io::Result<PathBuf> {
    let mut path = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        match std::fs::canonicalize(&path) {
            Ok(p) => return Ok(p),
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            Err(e) => match std::fs::read_link(&path) {
                // A dangling link: follow it to the file it names, relative to its own
                // directory.
                Ok(target) => {
                    path = match path.parent() {
                        Some(dir) if target.is_relative() => dir.join(target),
                        _ => target,
                    };
                }
                // Not a link: a file not made yet.
                Err(_) if std::fs::symlink_metadata(&path).is_err() => return Ok(path),
                Err(_) => return Err(e),
            },
        }
    }
    Err(io::Error::other(format!(
        "{}: too many levels of symbolic links",
        path.display()
    )))
}

/// Write `contents` to a temporary file beside `path` (flushed to disk) without
/// touching `path`: the first half of [`write_atomic`], for writers of several files
/// that stage them all before replacing any.
pub fn stage(path: &Path, contents: &[u8]) -> io::Result<AtomicFile> {
    let mut file = AtomicFile::create(path)?;
    file.write_all(contents)?;
    file.finish()?;
    Ok(file)
}

/// Replace `path` with `contents` atomically and durably: a reader sees the old file
/// or the new one, never a part, a failed write leaves the old one, and once this
/// returns a power loss cannot bring the old one back. Pipes, devices and open
/// descriptors (`--out /dev/stdout`) are written directly ([`AtomicFile::create`]).
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
    use std::cell::RefCell;

    thread_local! {
        /// The directories [`sync_dir`] synced on this thread (each test runs on its
        /// own), so a test sees that a commit made its rename durable.
        pub(super) static SYNCED_DIRS: RefCell<Vec<PathBuf>> = const { RefCell::new(Vec::new()) };
    }

    fn synced_dirs() -> Vec<PathBuf> {
        SYNCED_DIRS.with(|d| d.take())
    }

    #[test]
    fn a_failed_commit_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.json");
        write_atomic(&path, b"old").unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        // A directory put in the way after staging: the rename fails and the
        // temporary file goes.
        let blocked = dir.path().join("b.svg");
        let staged = stage(&blocked, b"x").unwrap();
        std::fs::create_dir(&blocked).unwrap();
        assert!(staged.commit().is_err());
        // Staged, never committed: the destination is untouched.
        drop(stage(&path, b"dropped").unwrap());
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    /// A committed write syncs the directory the file was renamed in (else a power
    /// loss can undo the rename), once and after the rename; one staged and dropped,
    /// or written in place, syncs none. A bare file name's directory is `.`.
    #[test]
    fn a_commit_syncs_the_directory_of_the_rename() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("results.json");
        synced_dirs();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(synced_dirs(), [std::fs::canonicalize(dir.path()).unwrap()]);
        drop(stage(&path, b"dropped").unwrap());
        write_atomic(Path::new("/dev/null"), b"gone").unwrap();
        assert_eq!(synced_dirs(), Vec::<PathBuf>::new());
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        sync_dir(Path::new("results.json")).unwrap();
        assert_eq!(synced_dirs(), [PathBuf::from(".")]);
    }

    /// A directory (or a path ending in `/`, existing or not) is refused naming the
    /// path, and nothing is created.
    #[test]
    fn a_directory_target_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("reports");
        std::fs::create_dir(&sub).unwrap();
        let absent = format!("{}/", dir.path().join("new").display());
        let slashed = format!("{}/", sub.display());
        for path in [sub.as_path(), Path::new(&slashed), Path::new(&absent)] {
            let e = write_atomic(path, b"x").unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::IsADirectory, "{e}");
            assert_eq!(
                e.to_string(),
                format!("{}: is a directory, not a file to write", path.display())
            );
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert_eq!(std::fs::read_dir(&sub).unwrap().count(), 0);
    }

    /// A path naming an open descriptor gets the bytes on that descriptor: a pipe
    /// (`--out /dev/stdout | ...`: no path a rename could reach) and a file opened to
    /// append (`>> log`: replaced, it lost what it held and the descriptor kept the
    /// unlinked old file).
    #[cfg(target_os = "linux")]
    #[test]
    fn an_open_descriptor_is_written_through() {
        use std::io::Read as _;
        use std::os::fd::AsRawFd as _;
        let (mut reader, writer) = io::pipe().unwrap();
        write_atomic(
            Path::new(&format!("/dev/fd/{}", writer.as_raw_fd())),
            b"on the pipe",
        )
        .unwrap();
        drop(writer);
        let mut got = String::new();
        reader.read_to_string(&mut got).unwrap();
        assert_eq!(got, "on the pipe");

        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        std::fs::write(&log, "kept\n").unwrap();
        let appended = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        // A link to the descriptor, as `/dev/stdout` is to `/proc/self/fd/1`.
        let link = dir.path().join("out");
        std::os::unix::fs::symlink(format!("/proc/self/fd/{}", appended.as_raw_fd()), &link)
            .unwrap();
        write_atomic(&link, b"added\n").unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "kept\nadded\n");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);

        assert!(names_a_descriptor(Path::new("/dev/stdout")));
        assert!(names_a_descriptor(Path::new("/proc/self/fd/0")));
        assert!(!names_a_descriptor(&log));
        assert!(!names_a_descriptor(Path::new("/dev/null")));
    }

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

    /// The replacement keeps the destination's mode, read-only included (created anew,
    /// a 0600 file came back 0644).
    #[cfg(unix)]
    #[test]
    fn an_atomic_write_keeps_the_files_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret.toml");
        for mode in [0o600, 0o400] {
            std::fs::write(&path, "old").unwrap_or(());
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            write_atomic(&path, b"new").unwrap();
            assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
            let got = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(got, mode, "{got:o}");
        }
    }

    /// A destination that is not a regular file is written in place, not replaced by
    /// one (a FIFO's reader gets the bytes, `/dev/null` stays a device), and a dangling
    /// link is followed to the file it names.
    #[cfg(unix)]
    #[test]
    fn pipes_devices_and_dangling_links_are_written_through() {
        use std::os::unix::fs::FileTypeExt as _;
        let dir = tempfile::tempdir().unwrap();
        write_atomic(Path::new("/dev/null"), b"gone").unwrap();
        assert!(std::fs::metadata("/dev/null")
            .unwrap()
            .file_type()
            .is_char_device());

        let fifo = dir.path().join("out.fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.as_ref().is_ok_and(|s| s.success()) {
            eprintln!("skipped the FIFO case: mkfifo failed ({made:?})");
        } else {
            let path = fifo.clone();
            let reader = std::thread::spawn(move || std::fs::read(path).unwrap());
            write_atomic(&fifo, b"through the pipe").unwrap();
            assert_eq!(reader.join().unwrap(), b"through the pipe");
            assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
        }

        let link = dir.path().join("dangling");
        std::os::unix::fs::symlink("missing.json", &link).unwrap();
        write_atomic(&link, b"made").unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            std::fs::read(dir.path().join("missing.json")).unwrap(),
            b"made"
        );
    }
}
