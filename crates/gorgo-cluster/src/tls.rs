//! Cluster certificates and the mutual-TLS configuration of the QUIC endpoint.
//!
//! One cluster CA signs one certificate per node. A node certificate names the node id
//! (the TLS server name used to dial a known peer) and [`CLUSTER_SERVER_NAME`] (used to
//! dial a seed whose id is not known yet). Both sides verify the chain against the CA
//! and nothing else, so a node with a foreign certificate can neither dial in nor be
//! dialed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gorgo_core::NodeId;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde::{Deserialize, Serialize};

use crate::error::{ClusterError, Result};

/// A name every node certificate carries besides its node id: lets a node dial a seed
/// address before it knows which node answers there.
pub const CLUSTER_SERVER_NAME: &str = "cluster.gorgo.internal";

/// ALPN of the cluster protocol, so that a stray QUIC client is refused early and a
/// node of another protocol version ([`gorgo_core::wire::PROTOCOL_VERSION`]) is
/// refused at the handshake, before either misreads the other's messages.
pub const ALPN: &[u8] = b"gorgo-cluster/9";

/// How long a node certificate is valid by default, in days (`gorgo certs --days`): a
/// leaked node key is good for this long at most, and a node is re-issued under the
/// same CA (`gorgo certs --out <dir> --nodes <id>`) and restarted before then.
pub const NODE_CERT_DAYS: u32 = 365;

/// Most days a node certificate may be valid (a hundred years: anything above is a
/// typo).
pub const MAX_NODE_CERT_DAYS: u32 = 36_500;

/// Largest PEM file read (a CA, a node certificate or key, the CA key `gorgo certs`
/// issues under), bytes: real ones are a few KiB, and a wrong path (`/dev/zero`) must
/// be refused, not read whole.
const MAX_PEM_FILE_BYTES: u64 = 1 << 20;

/// The name of the CA's files in a certificate directory (`ca.pem`, `ca.key`), beside
/// each node's `<id>.pem` and `<id>.key`: no node may have it as its id.
const CA_FILE_STEM: &str = "ca";

/// Paths of a node's TLS material on disk, as written by `gorgo certs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// The cluster CA certificate (PEM).
    pub ca: PathBuf,
    /// This node's certificate (PEM).
    pub cert: PathBuf,
    /// This node's private key (PKCS#8 PEM).
    pub key: PathBuf,
}

/// A node's TLS material in memory: what the endpoint is built from.
#[derive(Debug)]
pub struct NodeCredentials {
    /// The cluster CA: the only root peers are checked against.
    pub ca: CertificateDer<'static>,
    /// This node's certificate chain, leaf first.
    pub cert_chain: Vec<CertificateDer<'static>>,
    /// This node's private key.
    pub key: PrivateKeyDer<'static>,
}

impl Clone for NodeCredentials {
    fn clone(&self) -> Self {
        NodeCredentials {
            ca: self.ca.clone(),
            cert_chain: self.cert_chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl NodeCredentials {
    /// Load PEM files written by `gorgo certs`, and check that the key is the
    /// certificate's (what the endpoint's TLS configuration checks when the cluster
    /// starts). Errors name the file by its field of the node's `[tls]` table
    /// (`tls.ca`, `tls.cert`, `tls.key`). Each is read with a cap
    /// (1 MiB, `MAX_PEM_FILE_BYTES`).
    pub fn load(files: &TlsFiles) -> Result<Self> {
        let bad = |field: &'static str, path: &Path, why: String| ClusterError::Config {
            field,
            reason: format!("{}: {why}", path.display()),
        };
        let read = |field, p: &Path| {
            gorgo_files::read_capped_bytes(p, MAX_PEM_FILE_BYTES)
                .map_err(|e| bad(field, p, format!("cannot read it: {e}")))
        };
        let ca = CertificateDer::from_pem_slice(&read("tls.ca", &files.ca)?)
            .map_err(|e| bad("tls.ca", &files.ca, e.to_string()))?;
        let cert_chain = CertificateDer::pem_slice_iter(&read("tls.cert", &files.cert)?)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| bad("tls.cert", &files.cert, e.to_string()))?;
        if cert_chain.is_empty() {
            return Err(bad("tls.cert", &files.cert, "no certificate".into()));
        }
        let key = PrivateKeyDer::from_pem_slice(&read("tls.key", &files.key)?)
            .map_err(|e| bad("tls.key", &files.key, e.to_string()))?;
        let credentials = NodeCredentials {
            ca,
            cert_chain,
            key,
        };
        credentials.check_key().map_err(|e| match e {
            ClusterError::Config { field, reason } => ClusterError::Config {
                field,
                reason: format!(
                    "{}: {reason} (`tls.cert` {})",
                    files.key.display(),
                    files.cert.display()
                ),
            },
            other => other,
        })?;
        Ok(credentials)
    }

    /// Check that the private key is the one of the certificate (its public key is the
    /// leaf certificate's), as rustls does when it builds the endpoint's TLS
    /// configuration: a key of another node (or another certificate) is refused here,
    /// naming `tls.key`, and not at the cluster's start as a "key mismatch".
    pub fn check_key(&self) -> Result<()> {
        rustls::sign::CertifiedKey::from_der(
            self.cert_chain.clone(),
            self.key.clone_key(),
            &provider(),
        )
        .map(drop)
        .map_err(|e| ClusterError::Config {
            field: "tls.key",
            reason: match e {
                rustls::Error::InconsistentKeys(_) => {
                    "not the private key of the certificate".into()
                }
                other => format!("cannot be used: {other}"),
            },
        })
    }

    /// Check that this certificate is one the cluster's peers accept as `node`'s:
    /// signed by the CA, valid now, for both ends of a connection, and naming `node`.
    /// A node started with another node's certificate, or one from another CA, would
    /// otherwise sit alone, its packets dropped as another node's or its handshakes
    /// failing, with nothing above debug level to say why.
    pub fn check_identity(&self, node: &NodeId) -> Result<()> {
        self.check_identity_at(node, rustls::pki_types::UnixTime::now())
    }

    /// [`NodeCredentials::check_identity`] as of `now` (an expired certificate is
    /// refused, saying so).
    pub fn check_identity_at(&self, node: &NodeId, now: rustls::pki_types::UnixTime) -> Result<()> {
        use rustls::client::danger::ServerCertVerifier as _;
        let (leaf, intermediates) =
            self.cert_chain
                .split_first()
                .ok_or_else(|| ClusterError::Config {
                    field: "tls.cert",
                    reason: "no certificate".into(),
                })?;
        let refused = |e: rustls::Error| ClusterError::Config {
            field: "tls.cert",
            reason: format!("not one the cluster's CA (`tls.ca`) vouches for: {e}"),
        };
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(self)?, provider())
            .build()
            .map_err(|e| ClusterError::Tls(format!("client verifier: {e}")))?
            .verify_client_cert(leaf, intermediates, now)
            .map_err(refused)?;
        let name = rustls::pki_types::ServerName::try_from(node.0.clone()).map_err(|e| {
            ClusterError::Config {
                field: "node_id",
                reason: format!("{node}: {e}"),
            }
        })?;
        let verified =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots(self)?, provider())
                .build()
                .map_err(|e| ClusterError::Tls(format!("server verifier: {e}")))?
                .verify_server_cert(leaf, intermediates, &name, &[], now);
        match verified {
            Ok(_) => Ok(()),
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) => {
                let names: Vec<String> = webpki::EndEntityCert::try_from(leaf)
                    .map(|ee| {
                        ee.valid_dns_names()
                            .filter(|n| *n != CLUSTER_SERVER_NAME)
                            .map(str::to_owned)
                            .collect()
                    })
                    .unwrap_or_default();
                Err(ClusterError::Config {
                    field: "node_id",
                    reason: format!("{node}: the certificate is for {}", names.join(", ")),
                })
            }
            Err(e) => Err(refused(e)),
        }
    }
}

/// Refuse node ids that cannot be a DNS name in a certificate (they are TLS server names).
pub fn validate_node_id(id: &NodeId) -> Result<()> {
    let s = id.0.as_str();
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(ClusterError::Config {
            field: "node_id",
            reason: format!("{s:?}: use 1-63 of [a-z0-9-], not starting or ending with '-'"),
        })
    }
}

/// A cluster certificate authority: signs node certificates.
pub struct ClusterCa {
    issuer: Issuer<'static, KeyPair>,
    cert: CertificateDer<'static>,
    cert_pem: String,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

/// A node certificate and key as issued by [`ClusterCa::issue`].
#[derive(Debug)]
pub struct IssuedNode {
    /// Certificate PEM.
    pub cert_pem: String,
    /// PKCS#8 private key PEM.
    pub key_pem: String,
    /// The same material as credentials, ready for an endpoint.
    pub credentials: NodeCredentials,
}

impl ClusterCa {
    /// Generate a fresh CA (ECDSA P-256).
    pub fn generate(common_name: &str) -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(ClusterCa {
            cert: cert.der().clone(),
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA `gorgo certs` wrote before (its certificate and key, PEM), to issue more
    /// node certificates under it: a node added later must chain to the CA the running
    /// nodes trust. Refused when the key does not sign for the certificate.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self> {
        let key =
            KeyPair::from_pem(key_pem).map_err(|e| ClusterError::Tls(format!("ca key: {e}")))?;
        let cert = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| ClusterError::Tls(format!("ca certificate: {e}")))?;
        let issuer = Issuer::from_ca_cert_der(&cert, key)
            .map_err(|e| ClusterError::Tls(format!("ca certificate: {e}")))?;
        let ca = ClusterCa {
            issuer,
            cert,
            cert_pem: cert_pem.to_owned(),
        };
        // A certificate it signs must verify against it, or the two files do not belong
        // together (every node issued here would be refused by its peers).
        let probe = NodeId("ca-key-check".into());
        ca.issue(&probe)?
            .credentials
            .check_identity(&probe)
            .map_err(|_| {
                ClusterError::Tls("ca key does not belong to the ca certificate".into())
            })?;
        Ok(ca)
    }

    /// The CA certificate, DER.
    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.cert.clone()
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> String {
        self.cert_pem.clone()
    }

    /// The CA private key, PEM (keep it off the nodes).
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// Issue a certificate for `node`, valid as TLS server and client for
    /// [`NODE_CERT_DAYS`].
    pub fn issue(&self, node: &NodeId) -> Result<IssuedNode> {
        self.issue_for_days(node, NODE_CERT_DAYS)
    }

    /// Issue a certificate for `node`, valid as TLS server and client from an hour ago
    /// (peers' clocks may lag) for `days` days.
    pub fn issue_for_days(&self, node: &NodeId, days: u32) -> Result<IssuedNode> {
        validate_node_id(node)?;
        if !(1..=MAX_NODE_CERT_DAYS).contains(&days) {
            return Err(ClusterError::Config {
                field: "days",
                reason: format!("{days}: must be in [1, {MAX_NODE_CERT_DAYS}]"),
            });
        }
        let mut params =
            CertificateParams::new(vec![node.0.clone(), CLUSTER_SERVER_NAME.to_owned()])?;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(i64::from(days));
        params
            .distinguished_name
            .push(DnType::CommonName, node.0.as_str());
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let credentials = NodeCredentials {
            ca: self.cert_der(),
            cert_chain: vec![cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        };
        Ok(IssuedNode {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            credentials,
        })
    }
}

/// Write one certificate per node under `out` (`<node>.pem`, `<node>.key`), signed by
/// the CA in `out` (`ca.pem`, `ca.key`): the one already there, so that nodes added
/// later join the cluster the earlier ones trust, or a new one where there is none.
/// Each certificate is valid for `days` days. Returns the [`TlsFiles`] of each node,
/// in order.
///
/// A node named `ca` is refused, naming it: its `ca.pem` and `ca.key` would
/// overwrite the CA's own (every node then fails its handshakes with `UnknownIssuer`,
/// and the CA key is lost). So is a node listed twice (its second certificate would
/// replace the first).
pub fn write_cluster_certs(
    out: &Path,
    nodes: &[NodeId],
    days: u32,
) -> Result<Vec<(NodeId, TlsFiles)>> {
    if nodes.is_empty() {
        return Err(ClusterError::Config {
            field: "nodes",
            reason: "empty".into(),
        });
    }
    for (i, n) in nodes.iter().enumerate() {
        validate_node_id(n)?;
        if n.0 == CA_FILE_STEM {
            return Err(ClusterError::Config {
                field: "nodes",
                reason: format!(
                    "node id `{n}`: its certificate would overwrite the cluster CA's \
                     ({CA_FILE_STEM}.pem, {CA_FILE_STEM}.key); pick another id"
                ),
            });
        }
        if nodes[..i].contains(n) {
            return Err(ClusterError::Config {
                field: "nodes",
                reason: format!("node id `{n}` is listed twice"),
            });
        }
    }
    std::fs::create_dir_all(out)?;
    let ca_path = out.join(format!("{CA_FILE_STEM}.pem"));
    let key_path = out.join(format!("{CA_FILE_STEM}.key"));
    let ca = match (ca_path.exists(), key_path.exists()) {
        (false, false) => {
            let ca = ClusterCa::generate("gorgo cluster CA")?;
            std::fs::write(&ca_path, ca.cert_pem())?;
            write_secret(&key_path, ca.key_pem())?;
            ca
        }
        (true, true) => {
            let read = |p: &Path| {
                gorgo_files::read_capped(p, MAX_PEM_FILE_BYTES)
                    .map_err(|e| ClusterError::Tls(format!("reading {}: {e}", p.display())))
            };
            ClusterCa::from_pem(&read(&ca_path)?, &read(&key_path)?).map_err(|e| {
                ClusterError::Tls(format!(
                    "{} and {}: {e}",
                    ca_path.display(),
                    key_path.display()
                ))
            })?
        }
        (true, false) | (false, true) => {
            // Neither half can be made again: a new CA would leave every node issued
            // under the old one trusting a CA that signs nothing new.
            return Err(ClusterError::Tls(format!(
                "{} holds one of ca.pem and ca.key without the other; restore it, or remove it to start a new CA",
                out.display()
            )));
        }
    };
    let mut written = Vec::with_capacity(nodes.len());
    for n in nodes {
        let issued = ca.issue_for_days(n, days)?;
        let cert = out.join(format!("{n}.pem"));
        let key = out.join(format!("{n}.key"));
        std::fs::write(&cert, &issued.cert_pem)?;
        write_secret(&key, &issued.key_pem)?;
        written.push((
            n.clone(),
            TlsFiles {
                ca: ca_path.clone(),
                cert,
                key,
            },
        ));
    }
    Ok(written)
}

/// Write a secret (a private key, a config or cluster file holding the admin token)
/// readable by its owner only, where the platform allows: created 0600, so it is never
/// readable by others, not even between creation and a chmod.
pub fn write_secret(path: &Path, contents: impl AsRef<[u8]>) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut options = std::fs::OpenOptions::new();
    options.create(true).write(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut f = options.open(path)?;
    #[cfg(unix)]
    {
        // A file that existed keeps its old mode through `open`.
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    f.write_all(contents.as_ref())
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(creds: &NodeCredentials) -> Result<Arc<rustls::RootCertStore>> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(creds.ca.clone())
        .map_err(|e| ClusterError::Tls(format!("ca: {e}")))?;
    Ok(Arc::new(roots))
}

/// The QUIC server side: requires a client certificate signed by the cluster CA.
pub(crate) fn server_crypto(
    creds: &NodeCredentials,
) -> Result<quinn::crypto::rustls::QuicServerConfig> {
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(creds)?, provider())
            .build()
            .map_err(|e| ClusterError::Tls(format!("client verifier: {e}")))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| ClusterError::Tls(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(creds.cert_chain.clone(), creds.key.clone_key())
        .map_err(|e| ClusterError::Tls(format!("node cert (`tls.cert`, `tls.key`): {e}")))?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    quinn::crypto::rustls::QuicServerConfig::try_from(cfg)
        .map_err(|e| ClusterError::Tls(e.to_string()))
}

/// The QUIC client side: presents this node's certificate, trusts only the cluster CA.
pub(crate) fn client_crypto(
    creds: &NodeCredentials,
) -> Result<quinn::crypto::rustls::QuicClientConfig> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| ClusterError::Tls(e.to_string()))?
        .with_root_certificates(roots(creds)?)
        .with_client_auth_cert(creds.cert_chain.clone(), creds.key.clone_key())
        .map_err(|e| ClusterError::Tls(format!("node cert (`tls.cert`, `tls.key`): {e}")))?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    quinn::crypto::rustls::QuicClientConfig::try_from(cfg)
        .map_err(|e| ClusterError::Tls(e.to_string()))
}

/// A quinn client config speaking the cluster protocol with these credentials (for
/// tools and tests that talk to a node directly; nodes build theirs in [`crate::start`]).
pub fn quinn_client_config(creds: &NodeCredentials) -> Result<quinn::ClientConfig> {
    Ok(quinn::ClientConfig::new(Arc::new(client_crypto(creds)?)))
}

/// The node id named by the peer's (already CA-verified) certificate.
pub(crate) fn peer_node_id(conn: &quinn::Connection) -> Option<NodeId> {
    let identity = conn.peer_identity()?;
    let certs = identity.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    let leaf = certs.first()?;
    let ee = webpki::EndEntityCert::try_from(leaf).ok()?;
    let name = ee
        .valid_dns_names()
        .find(|n| *n != CLUSTER_SERVER_NAME)?
        .to_owned();
    let id = NodeId(name);
    validate_node_id(&id).ok()?;
    Some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alpn_names_the_protocol_version() {
        assert_eq!(
            ALPN,
            format!("gorgo-cluster/{}", gorgo_core::wire::PROTOCOL_VERSION).as_bytes()
        );
    }

    #[cfg(unix)]
    #[test]
    fn secrets_are_owner_only_even_over_a_world_readable_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.json");
        std::fs::write(&path, "old").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_secret(&path, "token").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "token");
        let fresh = dir.path().join("node.toml");
        write_secret(&fresh, b"x").unwrap();
        assert_eq!(
            std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn node_ids_are_dns_labels() {
        assert!(validate_node_id(&NodeId::from("us-ashburn")).is_ok());
        assert!(validate_node_id(&NodeId::from("")).is_err());
        assert!(validate_node_id(&NodeId::from("a.b")).is_err());
        assert!(validate_node_id(&NodeId::from("-a")).is_err());
        assert!(validate_node_id(&NodeId::from("A")).is_err());
    }

    #[test]
    fn written_certs_load_back() {
        let dir = tempfile::tempdir().unwrap();
        let nodes = vec![NodeId::from("a"), NodeId::from("b")];
        let files = write_cluster_certs(dir.path(), &nodes, NODE_CERT_DAYS).unwrap();
        assert_eq!(files.len(), 2);
        for (_, f) in &files {
            let creds = NodeCredentials::load(f).unwrap();
            assert_eq!(creds.cert_chain.len(), 1);
            server_crypto(&creds).unwrap();
            client_crypto(&creds).unwrap();
        }
        assert!(
            write_cluster_certs(dir.path(), &[NodeId::from("Bad Name")], NODE_CERT_DAYS).is_err()
        );
    }

    /// Another node's key beside this node's certificate is refused when the files are
    /// loaded (what `gorgo node --check` and a start read), naming `tls.key` and
    /// `tls.cert`: it passed the check, and the start failed with "keys may not be
    /// consistent: KeyMismatch". A file that cannot be read names its field once (it
    /// said "tls: tls: reading ...").
    #[test]
    fn a_key_of_another_certificate_or_a_missing_file_names_its_field() {
        let dir = tempfile::tempdir().unwrap();
        let nodes = [NodeId::from("a"), NodeId::from("b")];
        let files = write_cluster_certs(dir.path(), &nodes, NODE_CERT_DAYS).unwrap();
        let a = &files[0].1;
        let crossed = TlsFiles {
            key: files[1].1.key.clone(),
            ..a.clone()
        };
        let err = NodeCredentials::load(&crossed).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                err,
                ClusterError::Config {
                    field: "tls.key",
                    ..
                }
            ) && text.contains("b.key")
                && text.contains("`tls.cert`")
                && text.contains("a.pem"),
            "{text}"
        );
        for (field, files) in [
            (
                "tls.ca",
                TlsFiles {
                    ca: dir.path().join("nope.pem"),
                    ..a.clone()
                },
            ),
            (
                "tls.cert",
                TlsFiles {
                    cert: dir.path().join("nope.pem"),
                    ..a.clone()
                },
            ),
            (
                "tls.key",
                TlsFiles {
                    key: dir.path().join("nope.key"),
                    ..a.clone()
                },
            ),
        ] {
            let err = NodeCredentials::load(&files).unwrap_err();
            let text = err.to_string();
            assert!(
                matches!(err, ClusterError::Config { field: f, .. } if f == field)
                    && text.contains("nope.")
                    && !text.contains("tls: tls:"),
                "{field}: {text}"
            );
        }
        NodeCredentials::load(a).unwrap();
    }

    /// Every PEM file is read with a cap: one byte over it, or `/dev/zero` (which says
    /// it is empty), is refused naming its field (or the CA's file, for `gorgo
    /// certs`) and the cap, never read whole.
    #[cfg(unix)]
    #[test]
    fn a_pem_file_over_the_cap_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let files = write_cluster_certs(dir.path(), &[NodeId::from("a")], NODE_CERT_DAYS)
            .unwrap()
            .remove(0)
            .1;
        let big = dir.path().join("big.pem");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(MAX_PEM_FILE_BYTES + 1)
            .unwrap();
        let cap = format!("larger than {MAX_PEM_FILE_BYTES} bytes");
        let zero = Path::new("/dev/zero");
        for path in [big.as_path(), zero].into_iter().filter(|p| p.exists()) {
            for field in ["tls.ca", "tls.cert", "tls.key"] {
                let mut bad = files.clone();
                match field {
                    "tls.ca" => bad.ca = path.to_path_buf(),
                    "tls.cert" => bad.cert = path.to_path_buf(),
                    _ => bad.key = path.to_path_buf(),
                }
                let err = NodeCredentials::load(&bad).unwrap_err();
                let text = err.to_string();
                assert!(
                    matches!(err, ClusterError::Config { field: f, .. } if f == field)
                        && text.contains(&path.display().to_string())
                        && text.contains(&cap),
                    "{field}: {text}"
                );
            }
            // `gorgo certs` into a directory whose CA files are too big.
            let out = tempfile::tempdir().unwrap();
            std::os::unix::fs::symlink(path, out.path().join("ca.pem")).unwrap();
            std::os::unix::fs::symlink(path, out.path().join("ca.key")).unwrap();
            let text = write_cluster_certs(out.path(), &[NodeId::from("b")], NODE_CERT_DAYS)
                .unwrap_err()
                .to_string();
            assert!(text.contains("ca.pem") && text.contains(&cap), "{text}");
        }
    }

    /// A node named `ca` would write its certificate and key over the CA's, and a node
    /// listed twice would be issued twice: both refused, naming the id, before anything
    /// is written.
    #[test]
    fn a_node_named_like_the_ca_or_listed_twice_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_cluster_certs(
            dir.path(),
            &[NodeId::from("ca"), NodeId::from("us")],
            NODE_CERT_DAYS,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("`ca`") && err.contains("CA"), "{err}");
        assert!(!dir.path().join("ca.pem").exists(), "nothing written");
        let err = write_cluster_certs(
            dir.path(),
            &[NodeId::from("us"), NodeId::from("eu"), NodeId::from("us")],
            NODE_CERT_DAYS,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("`us`") && err.contains("twice"), "{err}");
        assert!(!dir.path().join("us.pem").exists(), "nothing written");
        // `ca` inside a longer id is any other id.
        write_cluster_certs(dir.path(), &[NodeId::from("ca-central")], NODE_CERT_DAYS).unwrap();
    }

    /// Adding a node later (`gorgo certs --out certs --nodes d` into the directory of
    /// a running cluster) issues it under the CA the others trust, and leaves that CA
    /// as it was: a new one would cut every node off its peers at its next restart.
    #[test]
    fn a_node_added_later_is_issued_under_the_clusters_ca() {
        let dir = tempfile::tempdir().unwrap();
        write_cluster_certs(dir.path(), &[NodeId::from("a")], NODE_CERT_DAYS).unwrap();
        let ca_pem = std::fs::read(dir.path().join("ca.pem")).unwrap();
        let ca_key = std::fs::read(dir.path().join("ca.key")).unwrap();
        let added = write_cluster_certs(dir.path(), &[NodeId::from("d")], NODE_CERT_DAYS).unwrap();
        assert_eq!(std::fs::read(dir.path().join("ca.pem")).unwrap(), ca_pem);
        assert_eq!(std::fs::read(dir.path().join("ca.key")).unwrap(), ca_key);
        let first = TlsFiles {
            ca: dir.path().join("ca.pem"),
            cert: dir.path().join("a.pem"),
            key: dir.path().join("a.key"),
        };
        let a = NodeCredentials::load(&first).unwrap();
        let d = NodeCredentials::load(&added[0].1).unwrap();
        // Each checks against the CA the other loaded.
        let d_under_a = NodeCredentials {
            ca: a.ca.clone(),
            ..d
        };
        d_under_a.check_identity(&NodeId::from("d")).unwrap();
    }

    /// Half a CA (its key lost, or a certificate copied without it) cannot be made
    /// whole again; a key that belongs to another CA signs nothing the nodes accept.
    #[test]
    fn half_a_ca_or_a_foreign_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        write_cluster_certs(dir.path(), &[NodeId::from("a")], NODE_CERT_DAYS).unwrap();
        let key = dir.path().join("ca.key");
        let saved = std::fs::read(&key).unwrap();
        std::fs::remove_file(&key).unwrap();
        let err =
            write_cluster_certs(dir.path(), &[NodeId::from("b")], NODE_CERT_DAYS).unwrap_err();
        assert!(err.to_string().contains("without the other"), "{err}");
        let other = ClusterCa::generate("another").unwrap();
        write_secret(&key, other.key_pem()).unwrap();
        let err =
            write_cluster_certs(dir.path(), &[NodeId::from("b")], NODE_CERT_DAYS).unwrap_err();
        assert!(err.to_string().contains("does not belong"), "{err}");
        write_secret(&key, saved).unwrap();
        write_cluster_certs(dir.path(), &[NodeId::from("b")], NODE_CERT_DAYS).unwrap();
    }

    /// A node certificate expires after the days it was issued for (a leaked key is
    /// not good for ever), and a node whose certificate has expired is told so at
    /// start; zero days, or more than a hundred years, is refused.
    #[test]
    fn a_node_certificate_expires_after_its_days() {
        let ca = ClusterCa::generate("ca").unwrap();
        let a = ca
            .issue_for_days(&NodeId::from("a"), 2)
            .unwrap()
            .credentials;
        let day = std::time::Duration::from_secs(86_400);
        let at = |d: std::time::Duration| {
            rustls::pki_types::UnixTime::since_unix_epoch(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    + d,
            )
        };
        a.check_identity_at(&NodeId::from("a"), at(day)).unwrap();
        let err = a
            .check_identity_at(&NodeId::from("a"), at(3 * day))
            .unwrap_err()
            .to_string();
        assert!(err.contains("xpired"), "{err}");
        for days in [0, MAX_NODE_CERT_DAYS + 1] {
            let err = ca.issue_for_days(&NodeId::from("a"), days).unwrap_err();
            assert!(err.to_string().contains("`days`"), "{err}");
        }
    }

    /// A node that starts with another node's certificate, or with one from another
    /// CA, is told so at start, naming `node_id`, instead of sitting alone.
    #[test]
    fn a_certificate_for_another_node_or_ca_is_refused_at_start() {
        let ca = ClusterCa::generate("ca").unwrap();
        let a = ca.issue(&NodeId::from("a")).unwrap().credentials;
        a.check_identity(&NodeId::from("a")).unwrap();
        let err = a.check_identity(&NodeId::from("b")).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("node_id") && text.contains("for a"), "{text}");
        let other = ClusterCa::generate("other").unwrap();
        let foreign = NodeCredentials {
            ca: other.cert_der(),
            ..a
        };
        let err = foreign.check_identity(&NodeId::from("a")).unwrap_err();
        assert!(err.to_string().contains("vouches"), "{err}");
    }
}
