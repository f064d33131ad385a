// SPDX-License-Identifier: Apache-2.0
//! Volumes and networks of an instance.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Largest inline cloud-init `userData` / `networkData` (decoded, for the
/// base64 forms) the API accepts: KubeVirt's `cloudInitUserMaxLen` and
/// `cloudInitNetworkMaxLen`. Larger data goes in a Secret.
pub const CLOUD_INIT_INLINE_MAX_BYTES: usize = 2048;

/// Decodes base64 as KubeVirt (Go's `StdEncoding`) does: padded standard
/// alphabet, line breaks ignored.
pub fn decode_std_base64(s: &str) -> Result<Vec<u8>, base64::DecodeError> {
    use base64::Engine;
    let compact: String = s.chars().filter(|c| !matches!(c, '\r' | '\n')).collect();
    base64::engine::general_purpose::STANDARD.decode(compact)
}

/// A volume of an instance: exactly one source.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VmVolume {
    /// Name; disks refer to it.
    #[serde(default)]
    pub name: String,
    /// A sheaf Volume named by `claimName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<ClaimSource>,
    /// A sheaf Volume named by `name` (usually from `dataVolumeTemplates`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_volume: Option<DataVolumeRef>,
    /// An ephemeral disk from an image (a local image path for sheaf runtimes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_disk: Option<ContainerDisk>,
    /// A NoCloud cloud-init disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init_no_cloud: Option<CloudInit>,
    /// A ConfigDrive cloud-init disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init_config_drive: Option<CloudInit>,
    /// A blank scratch disk that lives as long as the instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub empty_disk: Option<EmptyDisk>,
}

impl VmVolume {
    pub(super) fn source_count(&self) -> usize {
        [
            self.persistent_volume_claim.is_some(),
            self.data_volume.is_some(),
            self.container_disk.is_some(),
            self.cloud_init_no_cloud.is_some(),
            self.cloud_init_config_drive.is_some(),
            self.empty_disk.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count()
    }

    /// The sheaf Volume this volume uses, if any.
    pub fn sheaf_volume_name(&self) -> Option<&str> {
        self.persistent_volume_claim
            .as_ref()
            .map(|c| c.claim_name.as_str())
            .or(self.data_volume.as_ref().map(|d| d.name.as_str()))
    }
}

/// `persistentVolumeClaim` source.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClaimSource {
    /// Name of the sheaf Volume.
    #[serde(default)]
    pub claim_name: String,
    /// Attach read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
    /// Hot-pluggable (not yet supported; accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotpluggable: Option<bool>,
}

/// `dataVolume` source.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DataVolumeRef {
    /// Name of the sheaf Volume.
    #[serde(default)]
    pub name: String,
    /// Hot-pluggable (not yet supported; accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotpluggable: Option<bool>,
}

/// `containerDisk` source.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ContainerDisk {
    /// Image reference.
    #[serde(default)]
    pub image: String,
    /// Path of the disk inside the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Ignored; accepted for compatibility.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
}

/// cloud-init data.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CloudInit {
    /// User data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
    /// User data, base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data_base64: Option<String>,
    /// Network config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_data: Option<String>,
    /// Network config, base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_data_base64: Option<String>,
    /// User data from the `userdata` (or `userData`) key of a Secret in the
    /// instance's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretRef>,
    /// Network config from the `networkdata` (or `networkData`) key of a
    /// Secret in the instance's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_data_secret_ref: Option<SecretRef>,
}

/// A Secret in the instance's namespace (`LocalObjectReference`).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SecretRef {
    /// Name of the Secret.
    #[serde(default)]
    pub name: String,
}

/// `emptyDisk` source.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EmptyDisk {
    /// Size.
    pub capacity: Quantity,
}

/// A network.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Network {
    /// Name; interfaces refer to it.
    #[serde(default)]
    pub name: String,
    /// The default (pod) network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodNetwork>,
}

/// Pod network options.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodNetwork {
    /// Guest CIDR for masquerade.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "vmNetworkCIDR"
    )]
    pub vm_network_cidr: Option<String>,
}
