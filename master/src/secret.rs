//! Where the job secret comes from: `ECCL_SECRET`, else a secret file (created with a
//! fresh random secret, readable only by its owner, if it does not exist yet).

use std::path::{Path, PathBuf};

use eccl_protocol::auth::Secret;
use rand::RngCore;

/// `~/.eccl/secret`, the file peers on this host read when no variable names a secret.
pub fn default_secret_file() -> PathBuf {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".eccl").join("secret")
}

/// A new random secret, hex-encoded.
pub fn generate() -> String {
    let mut b = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut b);
    hex::encode(b)
}

/// Reads `path` (refused if others may read it), or creates it with a new secret,
/// readable by its owner only.
pub fn load_or_create(path: &Path) -> anyhow::Result<Secret> {
    if path.exists() {
        return Secret::read_file(path).map_err(|e| anyhow::anyhow!("secret file {e}"));
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let s = generate();
    write_private(path, s.as_bytes())?;
    Ok(Secret::new(s)?)
}

#[cfg(unix)]
fn write_private(path: &Path, data: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| anyhow::anyhow!("cannot create secret file {}: {e}", path.display()))?;
    f.write_all(data)?;
    Ok(())
}

#[cfg(not(unix))]
fn write_private(path: &Path, data: &[u8]) -> anyhow::Result<()> {
    std::fs::write(path, data)?;
    Ok(())
}
