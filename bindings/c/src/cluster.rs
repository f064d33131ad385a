// SPDX-License-Identifier: Apache-2.0
//! `sheaf_cluster`: a blocking client of a sheaf (Kubernetes-compatible)
//! API server.

use std::ffi::{c_char, c_int};

use sheaf_bindings_core::cluster::ClusterClient;

use crate::args::{opt_str_arg, out_arg, put, put_string, str_arg};
use crate::error::{FfiError, FfiResult, guard};
use crate::handle::{Registry, to_ptr, to_token};

/// A connection to a cluster API server (opaque).
#[derive(Debug)]
pub struct sheaf_cluster {
    _opaque: [u8; 0],
}

pub(crate) static CLUSTERS: Registry<ClusterClient> = Registry::new(5, "sheaf_cluster");

fn cluster(h: *const sheaf_cluster) -> FfiResult<std::sync::Arc<ClusterClient>> {
    CLUSTERS.get(to_token(h))
}

fn json(v: &serde_json::Value) -> FfiResult<String> {
    serde_json::to_string(v).map_err(|e| FfiError::invalid(format!("encode JSON: {e}")))
}

/// Connects to the API server at `url` (`https://HOST:PORT`) with bearer
/// `token` (NULL: none). `ca_pem` is the PEM CA certificate that signs the
/// server's certificate (NULL: the system bundle). No request is made yet.
///
/// # Safety
/// `url` is a NUL-terminated string; `token` and `ca_pem` are NULL or
/// NUL-terminated strings; `out` is valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_cluster_connect(
    url: *const c_char,
    token: *const c_char,
    ca_pem: *const c_char,
    out: *mut *mut sheaf_cluster,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let url = unsafe { str_arg(url, "url") }?;
        // SAFETY: per the contract.
        let token = unsafe { opt_str_arg(token, "token") }?;
        // SAFETY: per the contract.
        let ca = unsafe { opt_str_arg(ca_pem, "ca_pem") }?;
        let c = ClusterClient::connect(url, token, ca.map(str::as_bytes))?;
        // SAFETY: checked above.
        unsafe { put(out, to_ptr(CLUSTERS.insert(c))) };
        Ok(())
    })
}

/// Connects with a kubeconfig file (`path` NULL: `$KUBECONFIG`, then
/// `~/.kube/config`) and context (`context` NULL: its current context).
/// Token users only; the context's namespace becomes the default.
///
/// # Safety
/// `path` and `context` are NULL or NUL-terminated strings; `out` is valid
/// for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_cluster_connect_kubeconfig(
    path: *const c_char,
    context: *const c_char,
    out: *mut *mut sheaf_cluster,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let path = unsafe { opt_str_arg(path, "path") }?;
        // SAFETY: per the contract.
        let context = unsafe { opt_str_arg(context, "context") }?;
        let c = ClusterClient::from_kubeconfig(path.map(std::path::Path::new), context)?;
        // SAFETY: checked above.
        unsafe { put(out, to_ptr(CLUSTERS.insert(c))) };
        Ok(())
    })
}

/// Frees the connection.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_cluster_free(c: *mut sheaf_cluster) -> c_int {
    guard(|| {
        drop(CLUSTERS.remove(to_token(c))?);
        Ok(())
    })
}

/// Lists `VirtualMachine`s in `namespace` (NULL: all namespaces) as a JSON
/// array of objects (kubevirt.io/v1). Free with `sheaf_string_free`.
///
/// # Safety
/// `namespace` is NULL or a NUL-terminated string; `out_json` is valid for
/// writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_cluster_list_vms(
    c: *mut sheaf_cluster,
    namespace: *const c_char,
    out_json: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out_json, "out_json", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let ns = unsafe { opt_str_arg(namespace, "namespace") }?;
        let items = cluster(c)?.list_vms(ns)?;
        let j = json(&serde_json::Value::Array(items))?;
        // SAFETY: checked above.
        unsafe { put_string(out_json, &j) };
        Ok(())
    })
}

/// Writes the number of `VirtualMachine`s in `namespace` (NULL: all) to
/// `out_count`.
///
/// # Safety
/// `namespace` is NULL or a NUL-terminated string; `out_count` is valid for
/// writing one `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_cluster_count_vms(
    c: *mut sheaf_cluster,
    namespace: *const c_char,
    out_count: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out_count, "out_count", 0) }?;
        // SAFETY: per the contract.
        let ns = unsafe { opt_str_arg(namespace, "namespace") }?;
        let n = cluster(c)?.list_vms(ns)?.len();
        // SAFETY: checked above.
        unsafe { put(out_count, n) };
        Ok(())
    })
}

/// Gets one `VirtualMachine` as JSON (`namespace` NULL: the default).
/// Missing: `SHEAF_ENOENT`.
///
/// # Safety
/// `namespace` is NULL or a NUL-terminated string; `name` is one;
/// `out_json` is valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_cluster_get_vm(
    c: *mut sheaf_cluster,
    namespace: *const c_char,
    name: *const c_char,
    out_json: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out_json, "out_json", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let ns = unsafe { opt_str_arg(namespace, "namespace") }?;
        // SAFETY: per the contract.
        let name = unsafe { str_arg(name, "name") }?;
        let v = cluster(c)?.get_vm(ns, name)?;
        let j = json(&v)?;
        // SAFETY: checked above.
        unsafe { put_string(out_json, &j) };
        Ok(())
    })
}

/// Creates a `VirtualMachine` from a JSON or YAML manifest (namespace: the
/// manifest's, else `namespace`, else the default). Writes the stored
/// object to `out_json` unless it is NULL.
///
/// # Safety
/// `namespace` is NULL or a NUL-terminated string; `manifest` is one;
/// `out_json` is NULL or valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_cluster_create_vm(
    c: *mut sheaf_cluster,
    namespace: *const c_char,
    manifest: *const c_char,
    out_json: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: optional output per the contract.
        unsafe { put(out_json, std::ptr::null_mut()) };
        // SAFETY: per the contract.
        let ns = unsafe { opt_str_arg(namespace, "namespace") }?;
        // SAFETY: per the contract.
        let m = unsafe { str_arg(manifest, "manifest") }?;
        let v = cluster(c)?.create_vm(ns, m)?;
        if !out_json.is_null() {
            let j = json(&v)?;
            // SAFETY: non-NULL, writable per the contract.
            unsafe { put_string(out_json, &j) };
        }
        Ok(())
    })
}

/// Deletes a `VirtualMachine` (`namespace` NULL: the default).
///
/// # Safety
/// `namespace` is NULL or a NUL-terminated string; `name` is one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_cluster_delete_vm(
    c: *mut sheaf_cluster,
    namespace: *const c_char,
    name: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let ns = unsafe { opt_str_arg(namespace, "namespace") }?;
        // SAFETY: per the contract.
        let name = unsafe { str_arg(name, "name") }?;
        Ok(cluster(c)?.delete_vm(ns, name)?)
    })
}

/// Any API request: `method` (`"GET"`, ...), `path` (`"/apis/..."`),
/// optional `body` with `content_type` (NULL: `application/json`). Writes
/// the HTTP status to `out_status` and the body to `out_body` (free with
/// `sheaf_string_free`) whatever the status; only transport failures are
/// errors.
///
/// # Safety
/// `method` and `path` are NUL-terminated strings; `body` and
/// `content_type` are NULL or NUL-terminated; `out_status` and `out_body`
/// are valid for writing.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_cluster_request(
    c: *mut sheaf_cluster,
    method: *const c_char,
    path: *const c_char,
    body: *const c_char,
    content_type: *const c_char,
    out_status: *mut u16,
    out_body: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out_status, "out_status", 0) }?;
        // SAFETY: per the contract.
        unsafe { out_arg(out_body, "out_body", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let method = unsafe { str_arg(method, "method") }?;
        // SAFETY: per the contract.
        let path = unsafe { str_arg(path, "path") }?;
        // SAFETY: per the contract.
        let body = unsafe { opt_str_arg(body, "body") }?;
        // SAFETY: per the contract.
        let ct = unsafe { opt_str_arg(content_type, "content_type") }?;
        let r = cluster(c)?.request(
            method,
            path,
            body.map(|b| (ct.unwrap_or("application/json"), b.as_bytes().to_vec())),
        )?;
        // SAFETY: both checked above.
        unsafe {
            put(out_status, r.status);
            put_string(out_body, &String::from_utf8_lossy(&r.body));
        }
        Ok(())
    })
}
