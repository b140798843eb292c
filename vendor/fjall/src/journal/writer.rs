// Copyright (c) 2024-present, fjall-rs
// This source code is licensed under both the Apache 2.0 and MIT License
// (found in the LICENSE-* files in the repository)

use super::entry::{serialize_marker_item, Entry};
use crate::{
    batch::item::Item as BatchItem, file::fsync_directory, journal::recovery::JournalId,
    keyspace::InternalKeyspaceId,
};
use lsm_tree::{CompressionType, SeqNo, ValueType};
use std::{
    fs::{File, OpenOptions},
    hash::Hasher,
    io::{BufWriter, Seek, Write},
    path::{Path, PathBuf},
};

// TODO: this should be a database configuration
pub const PRE_ALLOCATED_BYTES: u64 = 64 * 1_024 * 1_024;

pub const JOURNAL_BUFFER_BYTES: usize = 8 * 1_024;

/// How far ahead of the journal's end its file is written with zeros (cairn's patch).
///
/// The preallocated file is a hole, so every write reaching a new block allocates it, and the
/// next `fdatasync` then writes the inode's block map too: a third device round trip after
/// the data and before the flush, on about one sync in nine of a small-record workload.
/// Zeros written ahead allocate the blocks once per chunk instead, with the sync that
/// follows. Recovery reads them as it reads the hole: the journal ends at the first zeros.
/// 64 KiB keeps what a small store allocates ahead small.
pub const ZEROED_AHEAD_BYTES: u64 = 64 * 1_024;

/// Zeros to write ahead from.
static ZEROS: [u8; ZEROED_AHEAD_BYTES as usize] = [0; ZEROED_AHEAD_BYTES as usize];

pub struct Writer {
    pub(crate) path: PathBuf,
    file: BufWriter<File>,
    buf: Vec<u8>,
    is_buffer_dirty: bool,

    /// Up to where the file holds written blocks, data or zeros; `None` when the file is
    /// appended to, where no zeros may be written ahead (cairn's patch).
    zeroed_to: Option<u64>,

    compression: CompressionType,
    compression_threshold: usize,
}

/// The persist mode allows setting the durability guarantee of previous writes
#[derive(Copy, Clone, Debug, Eq, PartialEq)]
pub enum PersistMode {
    /// Flushes data to OS buffers. This allows the OS to write out data in case of an
    /// application crash.
    ///
    /// When this function returns, data is **not** guaranteed to be persisted in case
    /// of a power loss event or OS crash.
    Buffer,

    /// Flushes data using `fdatasync`.
    ///
    /// Use if you know that `fdatasync` is sufficient for your file system and/or operating system.
    SyncData,

    /// Flushes data + metadata using `fsync`.
    SyncAll,
}

impl Writer {
    pub fn set_compression(&mut self, comp: CompressionType, threshold: usize) {
        self.compression = comp;
        self.compression_threshold = threshold;
    }

    pub fn pos(&mut self) -> crate::Result<u64> {
        self.file.stream_position().map_err(Into::into)
    }

    pub fn len(&self) -> crate::Result<u64> {
        Ok(self.file.get_ref().metadata()?.len())
    }

    pub fn rotate(&mut self) -> crate::Result<(PathBuf, PathBuf)> {
        self.persist(PersistMode::SyncAll)?;

        log::debug!(
            "Sealing active journal at {}, len={}B",
            self.path.display(),
            self.path
                .metadata()
                .inspect_err(|e| {
                    log::error!(
                        "Failed to get file metadata of journal file at {}: {e:?}",
                        self.path.display()
                    );
                })?
                .len(),
        );

        let prev_path = self.path.clone();

        let folder = self
            .path
            .parent()
            .expect("should have parent")
            .to_path_buf();

        let Some(basename) = self
            .path
            .file_name()
            .expect("should be valid file name")
            .to_str()
            .expect("should be valid utf-8")
            .strip_suffix(".jnl")
        else {
            log::error!("Invalid journal file name: {}", self.path.display());
            return Err(crate::Error::JournalRecovery(
                crate::JournalRecoveryError::InvalidFileName,
            ));
        };

        let journal_id = basename.parse::<JournalId>().map_err(|_| {
            log::error!("Invalid journal file name: {}", self.path.display());
            crate::Error::JournalRecovery(crate::JournalRecoveryError::InvalidFileName)
        })?;

        let new_path = folder.join(format!("{}.jnl", journal_id + 1));
        log::debug!("Rotating active journal to {}", new_path.display());

        let comp = self.compression;
        let compt = self.compression_threshold;
        *self = Self::create_new(new_path.clone())?;
        self.set_compression(comp, compt);

        // IMPORTANT: fsync folder on Unix
        fsync_directory(&folder)?;

        Ok((prev_path, new_path))
    }

    pub fn create_new<P: Into<PathBuf>>(path: P) -> crate::Result<Self> {
        let path = path.into();

        let file = File::create_new(&path).inspect_err(|e| {
            log::error!("Failed to create journal file at {}: {e:?}", path.display());
        })?;

        file.set_len(PRE_ALLOCATED_BYTES).inspect_err(|e| {
            log::error!(
                "Failed to set journal file size to {PRE_ALLOCATED_BYTES}B at {}: {e:?}",
                path.display(),
            );
        })?;

        file.sync_all().inspect_err(|e| {
            log::error!("Failed to fsync journal file at {}: {e:?}", path.display());
        })?;

        Ok(Self {
            path,
            file: BufWriter::new(file),
            buf: Vec::new(),
            is_buffer_dirty: false,
            zeroed_to: Some(0),
            compression: CompressionType::None,
            compression_threshold: 0,
        })
    }

    pub fn from_file<P: AsRef<Path>>(path: P) -> crate::Result<Self> {
        let path = path.as_ref();

        if !path.try_exists()? {
            let file = OpenOptions::new()
                .create_new(true)
                .write(true)
                .open(path)
                .inspect_err(|e| {
                    log::error!("Failed to create journal file at {}: {e:?}", path.display());
                })?;

            file.set_len(PRE_ALLOCATED_BYTES).inspect_err(|e| {
                log::error!(
                    "Failed to set journal file size to {PRE_ALLOCATED_BYTES}B at {}: {e:?}",
                    path.display(),
                );
            })?;

            file.sync_all().inspect_err(|e| {
                log::error!("Failed to fsync journal file at {}: {e:?}", path.display());
            })?;

            return Ok(Self {
                path: path.into(),
                file: BufWriter::with_capacity(JOURNAL_BUFFER_BYTES, file),
                buf: Vec::new(),
                is_buffer_dirty: false,
                zeroed_to: Some(0),
                compression: CompressionType::None,
                compression_threshold: 0,
            });
        }

        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .inspect_err(|e| {
                log::error!("Failed to open journal file at {}: {e:?}", path.display());
            })?;

        Ok(Self {
            path: path.into(),
            file: BufWriter::with_capacity(JOURNAL_BUFFER_BYTES, file),
            buf: Vec::new(),
            is_buffer_dirty: false,
            zeroed_to: None,
            compression: CompressionType::None,
            compression_threshold: 0,
        })
    }

    /// Writes on at `valid_end` of a recovered journal inside a file preallocated to
    /// [`PRE_ALLOCATED_BYTES`], as a new journal is written (cairn's patch).
    ///
    /// [`Writer::from_file`] opens a recovered journal for appending, and recovery has cut
    /// the file to its last whole batch. Every write would then grow the file, so every
    /// `fdatasync` would also write the inode's new size: on ext4 about half again as
    /// long as an `fdatasync` of data alone, until the journal rotates at 64 MB. Here the
    /// file is extended to its preallocated size (a hole, read back as zeros, where
    /// recovery stops as it does in a new journal), made durable with `sync_all`, and
    /// written from `valid_end` on. When the file's length is not `valid_end`, it is left
    /// to be appended to, as before.
    pub(crate) fn resume_at(&mut self, valid_end: u64) -> crate::Result<()> {
        self.file.flush()?;
        self.is_buffer_dirty = false;

        let mut file = OpenOptions::new().write(true).open(&self.path)?;
        if file.metadata()?.len() != valid_end {
            log::warn!(
                "Journal at {} is not cut at its last batch, appending to it",
                self.path.display(),
            );
            return Ok(());
        }

        if valid_end < PRE_ALLOCATED_BYTES {
            file.set_len(PRE_ALLOCATED_BYTES)?;
            file.sync_all()?;
        }
        file.seek(std::io::SeekFrom::Start(valid_end))?;

        self.file = BufWriter::with_capacity(JOURNAL_BUFFER_BYTES, file);
        self.zeroed_to = Some(valid_end);
        Ok(())
    }

    /// Writes the buffer out to the OS and starts the device's write of the journal's dirty
    /// pages without waiting for it (Linux `sync_file_range` with `SYNC_FILE_RANGE_WRITE`;
    /// elsewhere the buffer is written out only), so that a [`Writer::persist`] soon after
    /// waits for a write already under way (cairn's patch). Best effort: when writing the
    /// buffer out fails, the buffer stays dirty and the persist writes it, or fails, as it
    /// would have; the start of the device's write is a hint whose failure changes nothing.
    pub(crate) fn start_writeback(&mut self) {
        if !self.is_buffer_dirty {
            return;
        }
        if let Err(e) = self.file.flush() {
            log::warn!(
                "Failed to write out journal buffer at {}, leaving it to the persist: {e:?}",
                self.path.display(),
            );
            return;
        }
        self.is_buffer_dirty = false;

        #[cfg(target_os = "linux")]
        #[allow(unsafe_code)]
        {
            use std::os::fd::AsRawFd;

            // Offset 0 and length 0: every dirty page of the file, which holds only what was
            // written since the last sync.
            // SAFETY: a system call on a descriptor this writer holds open, with no pointers.
            let _ = unsafe {
                libc::sync_file_range(
                    self.file.get_ref().as_raw_fd(),
                    0,
                    0,
                    libc::SYNC_FILE_RANGE_WRITE,
                )
            };
        }
    }

    /// Persists the journal file.
    pub(crate) fn persist(&mut self, mode: PersistMode) -> std::io::Result<()> {
        log::trace!(
            "Persisting journal at {} with mode={mode:?}",
            self.path.display(),
        );

        if self.is_buffer_dirty {
            self.file.flush().inspect_err(|e| {
                log::error!(
                    "Failed to flush journal IO buffers at {}: {e:?}",
                    self.path.display(),
                );
            })?;
            self.is_buffer_dirty = false;
        }

        if mode != PersistMode::Buffer {
            self.zero_ahead();
        }

        match mode {
            PersistMode::SyncAll => self.file.get_mut().sync_all().inspect_err(|e| {
                log::error!(
                    "Failed to fsync journal file at {}: {e:?}",
                    self.path.display(),
                );
            }),
            PersistMode::SyncData => self.file.get_mut().sync_data().inspect_err(|e| {
                log::error!(
                    "Failed to fsyncdata journal file at {}: {e:?}",
                    self.path.display(),
                );
            }),
            PersistMode::Buffer => Ok(()),
        }
    }

    /// Writes zeros ahead of the journal's end once it comes within half of
    /// [`ZEROED_AHEAD_BYTES`] of the zeros written before, up to that distance past it and
    /// never past the preallocated length, so that the coming sync allocates the blocks
    /// the next writes land in (cairn's patch). Called with the buffer flushed, so that
    /// everything from the file's position on is zeros already; the position is asked of
    /// the file, never counted, so that a write that failed part way cannot leave zeros to
    /// be written over what follows it. A failure stops the zeros: the journal is then
    /// written into the hole, as fjall as released does.
    fn zero_ahead(&mut self) {
        let Some(zeroed_to) = self.zeroed_to else {
            return;
        };
        let end = match self.file.stream_position() {
            Ok(end) => end,
            Err(e) => {
                log::warn!(
                    "Failed to read the journal's position at {}, writing into the hole: {e:?}",
                    self.path.display(),
                );
                self.zeroed_to = None;
                return;
            }
        };
        if zeroed_to >= end + ZEROED_AHEAD_BYTES / 2 {
            return;
        }
        let mut from = zeroed_to.max(end);
        let to = (end + ZEROED_AHEAD_BYTES)
            .next_multiple_of(4_096)
            .min(PRE_ALLOCATED_BYTES);
        // Up to a block more than `ZEROS` holds when `end` is not on a block's start.
        #[cfg(unix)]
        while from < to {
            use std::os::unix::fs::FileExt;

            let len = usize::try_from(to - from)
                .unwrap_or(ZEROS.len())
                .min(ZEROS.len());
            if let Err(e) = self.file.get_ref().write_all_at(&ZEROS[..len], from) {
                log::warn!(
                    "Failed to write zeros ahead in journal at {}, writing into the hole: {e:?}",
                    self.path.display(),
                );
                self.zeroed_to = None;
                return;
            }
            from += len as u64;
        }
        self.zeroed_to = Some(to.max(zeroed_to));
    }

    /// Writes a batch start marker to the journal
    fn write_start(&mut self, item_count: u32, seqno: SeqNo) -> Result<usize, crate::Error> {
        debug_assert!(self.buf.is_empty());

        Entry::Start { item_count, seqno }.encode_into(&mut self.buf)?;

        self.file.write_all(&self.buf)?;

        Ok(self.buf.len())
    }

    /// Writes a batch end marker to the journal
    fn write_end(&mut self, checksum: u64) -> Result<usize, crate::Error> {
        debug_assert!(self.buf.is_empty());

        Entry::End(checksum).encode_into(&mut self.buf)?;

        self.file.write_all(&self.buf)?;

        Ok(self.buf.len())
    }

    pub(crate) fn write_raw(
        &mut self,
        keyspace_id: InternalKeyspaceId,
        key: &[u8],
        value: &[u8],
        value_type: ValueType,
        seqno: u64,
    ) -> crate::Result<usize> {
        self.is_buffer_dirty = true;

        let mut hasher = xxhash_rust::xxh3::Xxh3::default();
        let mut byte_count = 0;

        self.buf.clear();
        byte_count += self.write_start(1, seqno)?;
        self.buf.clear();

        serialize_marker_item(
            &mut self.buf,
            keyspace_id,
            key,
            value,
            value_type,
            if self.compression_threshold > 0 && value.len() >= self.compression_threshold {
                self.compression
            } else {
                CompressionType::None
            },
        )?;

        self.file.write_all(&self.buf)?;

        hasher.update(&self.buf);
        byte_count += self.buf.len();

        self.buf.clear();
        let checksum = hasher.finish();
        byte_count += self.write_end(checksum)?;

        Ok(byte_count)
    }

    pub(crate) fn write_clear(
        &mut self,
        keyspace_id: InternalKeyspaceId,
        seqno: SeqNo,
    ) -> crate::Result<usize> {
        self.is_buffer_dirty = true;

        let mut hasher = xxhash_rust::xxh3::Xxh3::default();
        let mut byte_count = 0;

        self.buf.clear();
        byte_count += self.write_start(1, seqno)?;
        self.buf.clear();

        Entry::Clear { keyspace_id }.encode_into(&mut self.buf)?;
        self.file.write_all(&self.buf)?;
        hasher.update(&self.buf);
        byte_count += self.buf.len();

        self.buf.clear();
        let checksum = hasher.finish();
        byte_count += self.write_end(checksum)?;

        Ok(byte_count)
    }

    pub fn write_batch<'a>(
        &mut self,
        items: impl Iterator<Item = &'a BatchItem>,
        batch_size: usize,
        seqno: SeqNo,
    ) -> crate::Result<usize> {
        if batch_size == 0 {
            return Ok(0);
        }

        self.is_buffer_dirty = true;

        self.buf.clear();

        // NOTE: entries.len() is surely never > u32::MAX
        #[expect(clippy::cast_possible_truncation)]
        let item_count = batch_size as u32;

        let mut hasher = xxhash_rust::xxh3::Xxh3::default();
        let mut byte_count = 0;

        byte_count += self.write_start(item_count, seqno)?;
        self.buf.clear();

        for item in items {
            debug_assert!(self.buf.is_empty());

            serialize_marker_item(
                &mut self.buf,
                item.keyspace.id,
                &item.key,
                &item.value,
                item.value_type,
                if self.compression_threshold > 0 && item.value.len() >= self.compression_threshold
                {
                    self.compression
                } else {
                    CompressionType::None
                },
            )?;

            self.file.write_all(&self.buf)?;

            hasher.update(&self.buf);
            byte_count += self.buf.len();

            self.buf.clear();
        }

        let checksum = hasher.finish();
        byte_count += self.write_end(checksum)?;

        Ok(byte_count)
    }
}
