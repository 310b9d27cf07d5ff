//! What a joined device receives from the router over its private link: the settings its
//! engine must share with the prefill node, and the model file.

use edgesplit_proto::join::{self, JoinError, Refusal, Reply};

use super::{Joins, CONNECTION_TIME};
use crate::backend::Pool;

impl Joins {
    /// The prefill node's [`join::Settings`], from its `Info`, or the refusal that says it
    /// does not answer.
    pub(super) async fn send_settings<W: tokio::io::AsyncWrite + Unpin>(
        link: &mut W,
        pool: &Pool,
    ) -> Result<(), JoinError> {
        match pool.first().prefill_info().await {
            Ok(i) => {
                let settings = join::Settings {
                    n_ctx: i.n_ctx,
                    flash_attn: i.flash_attn,
                    type_k: i.type_k,
                    type_v: i.type_v,
                };
                join::send(link, &settings).await?;
                Ok(())
            }
            Err(f) => {
                let message = format!("the prefill node does not answer: {}", f.message);
                join::send(
                    link,
                    &Reply::Refused {
                        reason: Refusal::Unavailable,
                        message: message.clone(),
                    },
                )
                .await?;
                Err(JoinError::Refused {
                    reason: Refusal::Unavailable,
                    message,
                })
            }
        }
    }

    /// The shared model file from byte `have` on, after its size and SHA-256 (computed
    /// once), each write allowed [`CONNECTION_TIME`].
    pub(super) async fn send_model<W: tokio::io::AsyncWrite + Unpin>(
        &self,
        link: &mut W,
        have: u64,
        peer: std::net::SocketAddr,
    ) -> Result<(), JoinError> {
        use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
        let Some(path) = self.model.clone() else {
            let m = "the router shares no model file (--share-model): copy it to the device";
            join::send(
                link,
                &Reply::Refused {
                    reason: Refusal::Unavailable,
                    message: m.into(),
                },
            )
            .await?;
            return Err(JoinError::Malformed(m.into()));
        };
        let (size, sha256) = self
            .model_sha
            .get_or_try_init(|| async {
                let p = path.clone();
                tokio::task::spawn_blocking(move || join::sha256_file(&p))
                    .await
                    .map_err(std::io::Error::other)?
            })
            .await?
            .clone();
        if have > size {
            let m = format!("the device holds {have} bytes of a {size}-byte file");
            join::send(
                link,
                &Reply::Refused {
                    reason: Refusal::Malformed,
                    message: m.clone(),
                },
            )
            .await?;
            return Err(JoinError::Malformed(m));
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        join::send(link, &join::ModelOffer { size, sha256, name }).await?;
        tracing::info!(%peer, from = have, size, "sending the model file");
        let mut file = tokio::fs::File::open(&path).await?;
        file.seek(std::io::SeekFrom::Start(have)).await?;
        let mut buf = vec![0u8; 1 << 20];
        let (mut sent, mut shown) = (have, have * 100 / size.max(1));
        loop {
            let n = file.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            tokio::time::timeout(CONNECTION_TIME, link.write_all(&buf[..n]))
                .await
                .map_err(|_| JoinError::Io(std::io::ErrorKind::TimedOut.into()))??;
            sent += n as u64;
            let percent = sent * 100 / size.max(1);
            if percent >= shown + 10 {
                shown = percent;
                tracing::info!(%peer, percent, "model file transfer");
            }
        }
        link.flush().await?;
        link.shutdown().await?;
        tracing::info!(%peer, size, "model file sent");
        Ok(())
    }
}
