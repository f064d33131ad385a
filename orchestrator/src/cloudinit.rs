// SPDX-License-Identifier: Apache-2.0
//! cloud-init seed disks: KubeVirt's `cloudInitNoCloud` (and
//! `cloudInitConfigDrive`) volumes.
//!
//! ```text
//!   VMI volume cloudInitNoCloud ─┬─ userData | userDataBase64 | secretRef ──► user-data
//!                                ├─ networkData | …Base64 | networkDataSecretRef ► network-config
//!                                └─ (instance uid, hostname) ─────────────────► meta-data
//!        Seed::image() ─► FAT image, volume label `cidata` (fatfs, in process)
//!        write_seed() ─► <launcher dir>/cidata-<volume>.img, 0600 ─► read-only virtio-blk disk
//! ```
//!
//! The image is made in Rust (the `fatfs` crate): no `mkfs` or `genisoimage`
//! runs on the node. cloud-init's NoCloud data source finds it by its
//! label (`blkid -t LABEL=cidata`) and reads the three files at its root.
//! A config drive is the same FAT image with label `config-2` and the files
//! under `openstack/latest/` (`meta_data.json`, `user_data`,
//! `network_data.json`), which cloud-init's ConfigDrive source accepts on
//! vfat as on iso9660.
//!
//! Limits: the API refuses inline data over KubeVirt's 2048 bytes
//! ([`INLINE_MAX_BYTES`], checked at admission); data from a Secret may be
//! up to [`MAX_FILE_BYTES`] (a Kubernetes Secret's own cap) per file. The
//! image is 2 MiB, grown by whole MiB for larger data (at most 4 MiB).

use std::collections::BTreeMap;
use std::io::{Cursor, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Secret;

use crate::names::{self, PathError};
pub use crate::resources::kubevirt::{
    CLOUD_INIT_INLINE_MAX_BYTES as INLINE_MAX_BYTES, decode_std_base64 as decode_base64,
};
use crate::resources::kubevirt::{CloudInit, VmVolume};

/// Which cloud-init data source a seed is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// NoCloud (`cloudInitNoCloud`): label `cidata`, `meta-data`,
    /// `user-data`, `network-config` at the root.
    NoCloud,
    /// OpenStack config drive (`cloudInitConfigDrive`): label `config-2`,
    /// `openstack/latest/{meta_data.json, user_data, network_data.json}`.
    ConfigDrive,
}

impl Flavor {
    /// The volume label cloud-init looks for (11 bytes, space padded).
    pub fn label(self) -> [u8; 11] {
        match self {
            Flavor::NoCloud => *b"cidata     ",
            Flavor::ConfigDrive => *b"config-2   ",
        }
    }

    /// The volume source's field name.
    pub fn field(self) -> &'static str {
        match self {
            Flavor::NoCloud => "cloudInitNoCloud",
            Flavor::ConfigDrive => "cloudInitConfigDrive",
        }
    }

    /// The flavor and data of a cloud-init volume, if it is one.
    pub fn of(v: &VmVolume) -> Option<(Flavor, &CloudInit)> {
        v.cloud_init_no_cloud
            .as_ref()
            .map(|c| (Flavor::NoCloud, c))
            .or(v
                .cloud_init_config_drive
                .as_ref()
                .map(|c| (Flavor::ConfigDrive, c)))
    }
}
/// Largest file in a seed (1 MiB, the size cap of a Kubernetes Secret).
pub const MAX_FILE_BYTES: usize = 1 << 20;
/// Smallest seed image.
pub const MIN_IMAGE_BYTES: u64 = 2 << 20;
/// Secret keys holding user data, in the order KubeVirt tries them.
pub const USER_DATA_KEYS: [&str; 2] = ["userdata", "userData"];
/// Secret keys holding network config, in the order KubeVirt tries them.
pub const NETWORK_DATA_KEYS: [&str; 2] = ["networkdata", "networkData"];

/// Why a seed could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// A `…Base64` field does not decode.
    #[error("{field}: not valid base64: {source}")]
    Base64 {
        /// The field (`spec.volumes[1].cloudInitNoCloud.userDataBase64`).
        field: String,
        /// Cause.
        source: base64::DecodeError,
    },
    /// A file would be larger than [`MAX_FILE_BYTES`].
    #[error("{field}: {len} bytes is over the {max}-byte limit of a cloud-init seed file")]
    TooLarge {
        /// Where the data came from.
        field: String,
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A referenced Secret does not exist (yet).
    #[error("{field}: Secret {namespace}/{name} not found")]
    SecretNotFound {
        /// The reference (`….secretRef`).
        field: String,
        /// Namespace of the instance.
        namespace: String,
        /// Secret name.
        name: String,
    },
    /// A referenced Secret has none of the keys that hold the data.
    #[error("{field}: Secret {namespace}/{name} has no {} key", keys.join(" or "))]
    SecretKeyMissing {
        /// The reference.
        field: String,
        /// Namespace of the instance.
        namespace: String,
        /// Secret name.
        name: String,
        /// The keys looked for.
        keys: &'static [&'static str],
    },
    /// Formatting or filling the FAT image failed.
    #[error("building the seed image: {0}")]
    Fat(std::io::Error),
    /// Writing the image file failed.
    #[error("writing the seed image {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The file name would leave its directory.
    #[error(transparent)]
    Path(#[from] PathError),
}

impl SeedError {
    /// The seed can be built once someone creates or fixes a Secret: the
    /// instance waits (stays pending) instead of failing.
    pub fn is_waiting_for_secret(&self) -> bool {
        matches!(
            self,
            SeedError::SecretNotFound { .. } | SeedError::SecretKeyMissing { .. }
        )
    }
}

/// Who the guest is, for `meta-data`.
#[derive(Debug, Clone)]
pub struct Instance<'a> {
    /// Namespace (Secrets are looked up here).
    pub namespace: &'a str,
    /// `instance-id` (the instance's uid: a new one per incarnation, so
    /// cloud-init runs its per-instance modules again).
    pub uid: &'a str,
    /// `local-hostname` (`spec.hostname`, else the instance name).
    pub hostname: &'a str,
}

/// The files of a seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    /// The data source it is for.
    pub flavor: Flavor,
    /// `meta-data` (YAML) or `meta_data.json`.
    pub meta_data: Vec<u8>,
    /// `user-data` / `user_data`, when given (NoCloud writes an empty
    /// `user-data` without it: cloud-init requires the file).
    pub user_data: Option<Vec<u8>>,
    /// `network-config` / `network_data.json`, when given.
    pub network_config: Option<Vec<u8>>,
}

/// A value as a YAML scalar that cannot break out of its line: a JSON
/// string is valid YAML.
fn yaml_str(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

fn checked(field: String, data: Vec<u8>) -> Result<Vec<u8>, SeedError> {
    if data.len() > MAX_FILE_BYTES {
        return Err(SeedError::TooLarge {
            field,
            len: data.len(),
            max: MAX_FILE_BYTES,
        });
    }
    Ok(data)
}

/// The value of the first of `keys` in a Secret (`stringData` wins over
/// `data`, as the Kubernetes API server merges them).
fn secret_value(secret: &Secret, keys: &[&str]) -> Option<Vec<u8>> {
    keys.iter().find_map(|k| {
        secret
            .string_data
            .as_ref()
            .and_then(|m| m.get(*k))
            .map(|s| s.as_bytes().to_vec())
            .or_else(|| secret.data.as_ref()?.get(*k).map(|b| b.0.clone()))
    })
}

/// One of the three ways to give a file: inline, base64, Secret.
fn source(
    field: &str,
    inline: (&str, Option<&str>),
    b64: (&str, Option<&str>),
    secret: (&str, Option<&str>),
    keys: &'static [&'static str],
    inst: &Instance<'_>,
    secrets: &BTreeMap<String, Secret>,
) -> Result<Option<Vec<u8>>, SeedError> {
    if let (name, Some(s)) = inline {
        return checked(format!("{field}.{name}"), s.as_bytes().to_vec()).map(Some);
    }
    if let (name, Some(s)) = b64 {
        let f = format!("{field}.{name}");
        let data = decode_base64(s).map_err(|source| SeedError::Base64 {
            field: f.clone(),
            source,
        })?;
        return checked(f, data).map(Some);
    }
    if let (name, Some(sname)) = secret {
        let f = format!("{field}.{name}");
        let Some(sec) = secrets.get(sname) else {
            return Err(SeedError::SecretNotFound {
                field: f,
                namespace: inst.namespace.to_string(),
                name: sname.to_string(),
            });
        };
        let Some(data) = secret_value(sec, keys) else {
            return Err(SeedError::SecretKeyMissing {
                field: f,
                namespace: inst.namespace.to_string(),
                name: sname.to_string(),
                keys,
            });
        };
        return checked(format!("Secret {}/{sname}", inst.namespace), data).map(Some);
    }
    Ok(None)
}

/// The Secrets a cloud-init volume refers to.
pub fn secret_names(ci: &CloudInit) -> impl Iterator<Item = &str> {
    [&ci.secret_ref, &ci.network_data_secret_ref]
        .into_iter()
        .flatten()
        .map(|r| r.name.as_str())
}

impl Seed {
    /// The seed for cloud-init volume `ci` (`field` is its path, for
    /// errors); `secrets` holds the Secrets of [`secret_names`] that exist.
    pub fn new(
        flavor: Flavor,
        ci: &CloudInit,
        field: &str,
        inst: &Instance<'_>,
        secrets: &BTreeMap<String, Secret>,
    ) -> Result<Seed, SeedError> {
        let user_data = source(
            field,
            ("userData", ci.user_data.as_deref()),
            ("userDataBase64", ci.user_data_base64.as_deref()),
            ("secretRef", ci.secret_ref.as_ref().map(|r| r.name.as_str())),
            &USER_DATA_KEYS,
            inst,
            secrets,
        )?;
        let network_config = source(
            field,
            ("networkData", ci.network_data.as_deref()),
            ("networkDataBase64", ci.network_data_base64.as_deref()),
            (
                "networkDataSecretRef",
                ci.network_data_secret_ref.as_ref().map(|r| r.name.as_str()),
            ),
            &NETWORK_DATA_KEYS,
            inst,
            secrets,
        )?;
        let meta_data = match flavor {
            Flavor::NoCloud => format!(
                "instance-id: {}\nlocal-hostname: {}\n",
                yaml_str(inst.uid),
                yaml_str(inst.hostname)
            ),
            // KubeVirt's ConfigDriveMetadata fields.
            Flavor::ConfigDrive => format!(
                "{}\n",
                serde_json::json!({
                    "instance_id": inst.uid,
                    "uuid": inst.uid,
                    "hostname": inst.hostname,
                    "local-hostname": inst.hostname,
                })
            ),
        }
        .into_bytes();
        Ok(Seed {
            flavor,
            meta_data,
            user_data: match flavor {
                Flavor::NoCloud => Some(user_data.unwrap_or_default()),
                Flavor::ConfigDrive => user_data,
            },
            network_config,
        })
    }

    /// The files, as (path in the image, bytes).
    pub fn files(&self) -> Vec<(&'static str, &[u8])> {
        let names = match self.flavor {
            Flavor::NoCloud => ["meta-data", "user-data", "network-config"],
            Flavor::ConfigDrive => [
                "openstack/latest/meta_data.json",
                "openstack/latest/user_data",
                "openstack/latest/network_data.json",
            ],
        };
        [
            Some(self.meta_data.as_slice()),
            self.user_data.as_deref(),
            self.network_config.as_deref(),
        ]
        .into_iter()
        .zip(names)
        .filter_map(|(d, n)| Some((n, d?)))
        .collect()
    }

    /// Size of the image: the data and 1 MiB for the file system, rounded
    /// up to whole MiB, at least [`MIN_IMAGE_BYTES`].
    pub fn image_size(&self) -> u64 {
        const MIB: u64 = 1 << 20;
        let data: u64 = self.files().iter().map(|(_, d)| d.len() as u64).sum();
        ((data + MIB).div_ceil(MIB) * MIB).max(MIN_IMAGE_BYTES)
    }

    /// The FAT image: the flavor's label (`fatfs` writes it in the boot
    /// sector and as the root directory's volume label entry, where `blkid`
    /// looks first) and the files. The same seed always gives the same
    /// bytes (no clock: every timestamp is 1980-01-01).
    pub fn image(&self, volume_id: u32) -> Result<Vec<u8>, SeedError> {
        let size = self.image_size();
        let mut disk = Cursor::new(vec![0u8; size as usize]);
        fatfs::format_volume(
            &mut disk,
            fatfs::FormatVolumeOptions::new()
                .volume_label(self.flavor.label())
                .volume_id(volume_id),
        )
        .map_err(SeedError::Fat)?;
        disk.seek(SeekFrom::Start(0)).map_err(SeedError::Fat)?;
        {
            let fs = fatfs::FileSystem::new(&mut disk, fatfs::FsOptions::new())
                .map_err(SeedError::Fat)?;
            let root = fs.root_dir();
            for (name, data) in self.files() {
                // Parent directories first (`openstack/latest`).
                let mut dir = root.clone();
                let mut parts: Vec<&str> = name.split('/').collect();
                let file = parts.pop().unwrap_or(name);
                for p in parts {
                    dir = match dir.open_dir(p) {
                        Ok(d) => d,
                        Err(_) => dir.create_dir(p).map_err(SeedError::Fat)?,
                    };
                }
                let mut f = dir.create_file(file).map_err(SeedError::Fat)?;
                f.write_all(data).map_err(SeedError::Fat)?;
                f.flush().map_err(SeedError::Fat)?;
            }
            drop(root);
            fs.unmount().map_err(SeedError::Fat)?;
        }
        Ok(disk.into_inner())
    }
}

/// A stable FAT volume serial for an instance (FNV-1a of its uid).
pub fn volume_id(uid: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in uid.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// The seed file name of cloud-init volume `volume` (one plain file name,
/// checked again by [`write_seed`]): `cidata-<volume>.img` or
/// `config-2-<volume>.img`.
pub fn seed_file_name(flavor: Flavor, volume: &str) -> String {
    let label = flavor.label();
    let label = String::from_utf8_lossy(&label);
    format!("{}-{volume}.img", label.trim_end())
}

/// Writes `image` to `dir/file` with mode 0600: a new temporary file
/// (`O_EXCL`, so nothing that already stands there, a symbolic link
/// included, is followed), synced, then renamed over the target.
pub fn write_seed(dir: &Path, file: &str, image: &[u8]) -> Result<PathBuf, SeedError> {
    let path = names::child(dir, file)?;
    let tmp = names::child(dir, &format!(".{file}.tmp"))?;
    let io = |source| SeedError::Io {
        path: path.clone(),
        source,
    };
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(e)),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(io)?;
    f.write_all(image).and_then(|_| f.sync_all()).map_err(io)?;
    drop(f);
    // rename(2) replaces whatever stands at `path` (a link included)
    // without following it.
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(path)
}

#[cfg(test)]
#[path = "cloudinit_tests.rs"]
mod tests;
