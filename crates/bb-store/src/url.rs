//! Where a store is: `file:///abs/dir` (or an absolute path), or
//! `s3://bucket[/prefix]?endpoint=http://127.0.0.1:9000&region=us-east-1`. S3 credentials come
//! from the daemon's environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, and the other
//! variables `object_store` reads), never from the URL, so they are not in logs or records.

use crate::{Result, StoreError};
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::prefix::PrefixStore;
use object_store::{BackoffConfig, ObjectStore, RetryConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    Local(PathBuf),
    S3 { bucket: String, prefix: String, endpoint: Option<String>, region: String },
}

impl std::fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreUrl::Local(dir) => write!(f, "file://{}", dir.display()),
            StoreUrl::S3 { bucket, prefix, endpoint, .. } => {
                write!(f, "s3://{bucket}")?;
                if !prefix.is_empty() {
                    write!(f, "/{prefix}")?;
                }
                if let Some(e) = endpoint {
                    write!(f, " at {e}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::str::FromStr for StoreUrl {
    type Err = StoreError;

    fn from_str(url: &str) -> Result<StoreUrl> {
        let bad = |why: &str| StoreError::BadUrl { url: url.to_string(), why: why.to_string() };
        if let Some(path) = url.strip_prefix("file://").or_else(|| url.starts_with('/').then_some(url)) {
            if !path.starts_with('/') {
                return Err(bad("a local store is an absolute directory: file:///var/lib/branchbox/store"));
            }
            return Ok(StoreUrl::Local(PathBuf::from(path)));
        }
        let Some(rest) = url.strip_prefix("s3://") else {
            return Err(bad("use file:///dir or s3://bucket[/prefix]?endpoint=URL&region=R"));
        };
        let (loc, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (bucket, prefix) = loc.split_once('/').unwrap_or((loc, ""));
        if bucket.is_empty() {
            return Err(bad("no bucket: s3://bucket[/prefix]"));
        }
        let (mut endpoint, mut region) = (None, "us-east-1".to_string());
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("endpoint", v)) if !v.is_empty() => endpoint = Some(v.to_string()),
                Some(("region", v)) if !v.is_empty() => region = v.to_string(),
                _ => return Err(bad(&format!("unknown or empty parameter {pair:?} (endpoint, region)"))),
            }
        }
        Ok(StoreUrl::S3 { bucket: bucket.to_string(), prefix: prefix.trim_matches('/').to_string(), endpoint, region })
    }
}

impl StoreUrl {
    pub(crate) fn build(&self, credentials: Option<(&str, &str)>) -> Result<Arc<dyn ObjectStore>> {
        let backend = |source| StoreError::Backend { store: self.to_string(), source };
        match self {
            StoreUrl::Local(dir) => {
                std::fs::create_dir_all(dir).map_err(StoreError::io(format!("create {}", dir.display())))?;
                Ok(Arc::new(LocalFileSystem::new_with_prefix(dir).map_err(backend)?))
            }
            StoreUrl::S3 { bucket, prefix, endpoint, region } => {
                let retry = RetryConfig {
                    backoff: BackoffConfig::default(),
                    max_retries: 6,
                    retry_timeout: Duration::from_secs(20),
                };
                let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket).with_region(region).with_retry(retry);
                if let Some((id, secret)) = credentials {
                    b = b.with_access_key_id(id).with_secret_access_key(secret);
                }
                if let Some(e) = endpoint {
                    b = b.with_endpoint(e).with_allow_http(e.starts_with("http://"));
                }
                let s3 = b.build().map_err(backend)?;
                if prefix.is_empty() {
                    Ok(Arc::new(s3))
                } else {
                    Ok(Arc::new(PrefixStore::new(s3, prefix.as_str())))
                }
            }
        }
    }
}
