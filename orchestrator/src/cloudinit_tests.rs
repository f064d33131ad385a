// SPDX-License-Identifier: Apache-2.0
//! Seeds read back with fatfs and with the host's `blkid` and mtools.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use k8s_openapi::ByteString;

use super::*;
use crate::resources::kubevirt::SecretRef;

const INST: Instance<'static> = Instance {
    namespace: "default",
    uid: "0d6e1c2a-7a40-4a8e-9e0b-2f1f3c1d9a55",
    hostname: "vm1",
};

fn run(cmd: &mut Command) -> Vec<u8> {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e} (scripts/setup installs it)"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// `mtype -i IMG ::NAME`: the file as mtools reads it.
fn mtype(img: &Path, name: &str) -> Vec<u8> {
    run(Command::new("mtype")
        .env("MTOOLS_SKIP_CHECK", "1")
        .arg("-i")
        .arg(img)
        .arg(format!("::{name}")))
}

fn blkid(img: &Path) -> String {
    // -p: probe the file itself, not the cache.
    String::from_utf8(run(Command::new("blkid")
        .args(["-p", "-o", "export"])
        .arg(img)))
    .unwrap()
}

fn secret(data: &[(&str, &[u8])], string_data: &[(&str, &str)]) -> Secret {
    Secret {
        data: (!data.is_empty()).then(|| {
            data.iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.to_vec())))
                .collect()
        }),
        string_data: (!string_data.is_empty()).then(|| {
            string_data
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        }),
        ..Default::default()
    }
}

const USER: &str = "#cloud-config\nruncmd:\n  - [sh, -c, 'echo sheaf-marker > /dev/ttyS0']\n";
const NET: &str = "version: 2\nethernets:\n  eth0:\n    dhcp4: true\n";

#[test]
fn seed_reads_back_with_blkid_mtools_and_fatfs() {
    let ci = CloudInit {
        user_data: Some(USER.into()),
        network_data: Some(NET.into()),
        ..Default::default()
    };
    let seed = Seed::new(
        Flavor::NoCloud,
        &ci,
        "spec.volumes[1].cloudInitNoCloud",
        &INST,
        &BTreeMap::new(),
    )
    .unwrap();
    let img = seed.image(volume_id(INST.uid)).unwrap();
    assert_eq!(img.len() as u64, MIN_IMAGE_BYTES);
    assert_eq!(
        img,
        seed.image(volume_id(INST.uid)).unwrap(),
        "reproducible"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = write_seed(
        dir.path(),
        &seed_file_name(Flavor::NoCloud, "cloudinitdisk"),
        &img,
    )
    .unwrap();
    assert_eq!(path, dir.path().join("cidata-cloudinitdisk.img"));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the seed may hold secrets");

    let id = blkid(&path);
    assert!(id.contains("LABEL=cidata\n"), "{id}");
    assert!(id.contains("TYPE=vfat\n"), "{id}");
    assert_eq!(mtype(&path, "user-data"), USER.as_bytes());
    assert_eq!(mtype(&path, "network-config"), NET.as_bytes());
    let meta = String::from_utf8(mtype(&path, "meta-data")).unwrap();
    assert_eq!(
        meta,
        format!("instance-id: \"{}\"\nlocal-hostname: \"vm1\"\n", INST.uid)
    );
    let listing = String::from_utf8(run(Command::new("mdir")
        .env("MTOOLS_SKIP_CHECK", "1")
        .args(["-b", "-i"])
        .arg(&path)
        .arg("::/")))
    .unwrap();
    let mut names: Vec<&str> = listing
        .lines()
        .map(|l| l.trim_start_matches("::/"))
        .collect();
    names.sort();
    assert_eq!(names, ["meta-data", "network-config", "user-data"]);

    // The same crate reads it back: label in the boot sector and the root.
    let fs = fatfs::FileSystem::new(std::fs::File::open(&path).unwrap(), fatfs::FsOptions::new())
        .unwrap();
    assert_eq!(fs.volume_label(), "cidata");
    assert_eq!(
        fs.read_volume_label_from_root_dir().unwrap().as_deref(),
        Some("cidata")
    );
    let mut got = String::new();
    fs.root_dir()
        .open_file("user-data")
        .unwrap()
        .read_to_string(&mut got)
        .unwrap();
    assert_eq!(got, USER);
}

#[test]
fn base64_and_secret_sources() {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(USER);
    // Line-wrapped base64 (as `base64` prints it) decodes like Go's does.
    let wrapped = format!("{}\n{}\n", &b64[..20], &b64[20..]);
    let ci = CloudInit {
        user_data_base64: Some(wrapped),
        network_data_secret_ref: Some(SecretRef { name: "net".into() }),
        ..Default::default()
    };
    let mut secrets = BTreeMap::new();
    secrets.insert(
        "net".to_string(),
        secret(&[("networkdata", NET.as_bytes())], &[]),
    );
    let s = Seed::new(Flavor::NoCloud, &ci, "v", &INST, &secrets).unwrap();
    assert_eq!(s.user_data.as_deref(), Some(USER.as_bytes()));
    assert_eq!(s.network_config.as_deref(), Some(NET.as_bytes()));

    // secretRef: `userdata`, else `userData`; stringData wins over data.
    let ci = CloudInit {
        secret_ref: Some(SecretRef { name: "ud".into() }),
        ..Default::default()
    };
    secrets.insert(
        "ud".into(),
        secret(
            &[("userData", b"from data")],
            &[("userData", "from stringData")],
        ),
    );
    let s = Seed::new(Flavor::NoCloud, &ci, "v", &INST, &secrets).unwrap();
    assert_eq!(s.user_data.as_deref(), Some(&b"from stringData"[..]));
    assert_eq!(s.network_config, None);
    secrets.insert("ud".into(), secret(&[("userdata", b"lower")], &[]));
    assert_eq!(
        Seed::new(Flavor::NoCloud, &ci, "v", &INST, &secrets)
            .unwrap()
            .user_data
            .as_deref(),
        Some(&b"lower"[..])
    );

    // Missing Secret or key: waiting, with a message naming it.
    let e = Seed::new(
        Flavor::NoCloud,
        &ci,
        "spec.volumes[0].cloudInitNoCloud",
        &INST,
        &BTreeMap::new(),
    )
    .unwrap_err();
    assert!(e.is_waiting_for_secret());
    assert_eq!(
        e.to_string(),
        "spec.volumes[0].cloudInitNoCloud.secretRef: Secret default/ud not found"
    );
    secrets.insert("ud".into(), secret(&[("other", b"x")], &[]));
    let e = Seed::new(Flavor::NoCloud, &ci, "v", &INST, &secrets).unwrap_err();
    assert!(e.is_waiting_for_secret());
    assert_eq!(
        e.to_string(),
        "v.secretRef: Secret default/ud has no userdata or userData key"
    );
}

#[test]
fn hostile_input_is_refused() {
    // Invalid base64: a clear error naming the field, not a panic.
    let ci = CloudInit {
        user_data_base64: Some("not base64!".into()),
        ..Default::default()
    };
    let e = Seed::new(
        Flavor::NoCloud,
        &ci,
        "spec.volumes[1].cloudInitNoCloud",
        &INST,
        &BTreeMap::new(),
    )
    .unwrap_err();
    assert!(!e.is_waiting_for_secret());
    assert!(
        e.to_string()
            .starts_with("spec.volumes[1].cloudInitNoCloud.userDataBase64: not valid base64"),
        "{e}"
    );

    // Huge user data (from a Secret, where the API's 2 KiB cap does not
    // apply): 1 MiB is the limit.
    let ci = CloudInit {
        secret_ref: Some(SecretRef { name: "big".into() }),
        ..Default::default()
    };
    let mut secrets = BTreeMap::new();
    let big = vec![b'x'; MAX_FILE_BYTES + 1];
    secrets.insert("big".to_string(), secret(&[("userdata", &big)], &[]));
    let e = Seed::new(Flavor::NoCloud, &ci, "v", &INST, &secrets).unwrap_err();
    assert_eq!(
        e.to_string(),
        "Secret default/big: 1048577 bytes is over the 1048576-byte limit of a cloud-init seed file"
    );
    // Exactly the limit fits: the image grows and the file reads back whole.
    let max: Vec<u8> = (0..MAX_FILE_BYTES).map(|i| (i % 251) as u8).collect();
    secrets.insert("big".to_string(), secret(&[("userdata", &max)], &[]));
    let seed = Seed::new(Flavor::NoCloud, &ci, "v", &INST, &secrets).unwrap();
    let img = seed.image(1).unwrap();
    assert_eq!(img.len(), 3 << 20);
    let dir = tempfile::tempdir().unwrap();
    let p = write_seed(dir.path(), "big.img", &img).unwrap();
    assert_eq!(mtype(&p, "user-data"), max);

    // A hostname cannot add lines to meta-data.
    let inst = Instance {
        hostname: "vm\ninstance-id: other",
        ..INST
    };
    let s = Seed::new(
        Flavor::NoCloud,
        &CloudInit::default(),
        "v",
        &inst,
        &BTreeMap::new(),
    )
    .unwrap();
    let meta = String::from_utf8(s.meta_data).unwrap();
    assert_eq!(meta.lines().count(), 2, "{meta}");
    assert!(meta.ends_with("local-hostname: \"vm\\ninstance-id: other\"\n"));

    // File names that would leave the directory, or a link in the target's
    // place, are refused and nothing is written outside.
    let outside = tempfile::tempdir().unwrap();
    for bad in ["../x.img", "a/b.img", "", "..", "/etc/x"] {
        assert!(
            matches!(write_seed(dir.path(), bad, &img), Err(SeedError::Path(_))),
            "{bad:?}"
        );
    }
    let target = outside.path().join("victim");
    std::fs::write(&target, b"keep").unwrap();
    std::os::unix::fs::symlink(&target, dir.path().join("link.img")).unwrap();
    assert!(matches!(
        write_seed(dir.path(), "link.img", &img),
        Err(SeedError::Path(_))
    ));
    // A link where the temporary file goes is refused too.
    std::os::unix::fs::symlink(&target, dir.path().join(".t.img.tmp")).unwrap();
    assert!(matches!(
        write_seed(dir.path(), "t.img", b"seed"),
        Err(SeedError::Path(_))
    ));
    assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    assert!(!dir.path().join("t.img").exists());
    // A stale temporary file (a crash mid-write) is replaced.
    std::fs::write(dir.path().join(".u.img.tmp"), b"stale").unwrap();
    write_seed(dir.path(), "u.img", b"seed").unwrap();
    assert_eq!(std::fs::read(dir.path().join("u.img")).unwrap(), b"seed");
    assert!(!dir.path().join(".u.img.tmp").exists());
}

#[test]
fn config_drive_reads_back_with_blkid_and_mtools() {
    let ci = CloudInit {
        user_data: Some(USER.into()),
        network_data: Some("{\"links\": []}".into()),
        ..Default::default()
    };
    let seed = Seed::new(Flavor::ConfigDrive, &ci, "v", &INST, &BTreeMap::new()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = write_seed(
        dir.path(),
        &seed_file_name(Flavor::ConfigDrive, "cfg"),
        &seed.image(7).unwrap(),
    )
    .unwrap();
    assert_eq!(path, dir.path().join("config-2-cfg.img"));
    let id = blkid(&path);
    assert!(
        id.contains("LABEL=config-2\n") && id.contains("TYPE=vfat\n"),
        "{id}"
    );
    assert_eq!(mtype(&path, "openstack/latest/user_data"), USER.as_bytes());
    assert_eq!(
        mtype(&path, "openstack/latest/network_data.json"),
        b"{\"links\": []}"
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&mtype(&path, "openstack/latest/meta_data.json")).unwrap();
    assert_eq!(meta["uuid"], INST.uid);
    assert_eq!(meta["instance_id"], INST.uid);
    assert_eq!(meta["hostname"], "vm1");

    // Without user data a config drive has no user_data file (NoCloud
    // always has an empty user-data).
    let only_net = CloudInit {
        network_data: Some("{}".into()),
        ..Default::default()
    };
    let cd = Seed::new(Flavor::ConfigDrive, &only_net, "v", &INST, &BTreeMap::new()).unwrap();
    let names: Vec<&str> = cd.files().iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        [
            "openstack/latest/meta_data.json",
            "openstack/latest/network_data.json"
        ]
    );
    let nc = Seed::new(Flavor::NoCloud, &only_net, "v", &INST, &BTreeMap::new()).unwrap();
    let names: Vec<&str> = nc.files().iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["meta-data", "user-data", "network-config"]);
}
