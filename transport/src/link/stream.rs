//! Links over byte streams (TCP, TLS over TCP, QUIC streams): a sending half driven by
//! the caller and a receiving half fed by one reader task per stream.
//!
//! A link may have several streams (`ECCL_NSTREAMS`): the frames of one region are dealt
//! round-robin across them and written concurrently, which helps when one TCP connection
//! cannot fill the path. Frames carry their offset, so the receiver does not care in
//! which order they arrive.

use std::io::IoSlice;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::frame::{FrameHeader, FrameKind, FRAME_HEADER_LEN};
use futures::future::try_join_all;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use futures::future::BoxFuture;

use super::{
    Frames, Incoming, LinkEvent, LinkObserver, LinkRx, LinkTx, Payload, RecvHalf, SendHalf,
    Transport,
};
use crate::pool::Pool;
use crate::TransportError;

/// Frames a stream's reader may hold before the executor consumes them.
const POOL_FRAMES: usize = 8;

/// What carries a stream link's streams, when that needs an orderly end (a QUIC
/// connection: its send buffers live in this process, so closing it early would drop
/// data that a returned send promised to deliver, which a TCP socket's kernel buffer
/// would not).
pub trait LinkGuard: Send + Sync + 'static {
    /// This side sent `Close` on every stream.
    fn done_sending(&self);
    /// Every stream delivered the peer's `Close`: the peer sends nothing more.
    fn drained(&self);
    /// Resolves when the carrier has closed (both sides done).
    fn closed(&self) -> futures::future::BoxFuture<'static, ()>;
}

/// How long a closing link waits for the peer to take what it sent.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// One direction of a byte stream, whatever its type (TCP, TLS, a QUIC stream).
pub type BoxWrite = Box<dyn AsyncWrite + Send + Unpin>;
pub type BoxRead = Box<dyn AsyncRead + Send + Unpin>;

/// Sending half of a stream link.
pub(crate) struct StreamTx {
    streams: Vec<BoxWrite>,
    /// The TCP sockets under the streams, when they are TCP connections (their
    /// counters: [`super::tcp_info`]); held open by `streams`.
    tcp_fds: Vec<std::os::fd::RawFd>,
    peer: String,
    guard: Option<Arc<dyn LinkGuard>>,
    /// Set while a frame is being written; still set afterwards means the write was
    /// interrupted and the peer's reader would lose its place in the stream.
    poisoned: bool,
}

impl StreamTx {
    /// Sends `payload` as frames of at most `frame_bytes` bytes (a multiple of
    /// `align`), each with `header` and its own `offset`/`len`. An empty payload is sent
    /// as one empty frame, so every send is seen by the receiver. Every frame must make
    /// progress within `timeout`.
    async fn region(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        frame_bytes: usize,
        align: usize,
        timeout: Duration,
    ) -> Result<(), TransportError> {
        if self.poisoned {
            return Err(TransportError::Poisoned {
                peer: self.peer.clone(),
            });
        }
        let frames = Frames::new(
            header,
            payload,
            frame_bytes,
            align,
            eccl_protocol::MAX_FRAME_PAYLOAD,
        );
        let nframes = frames.count();
        self.poisoned = true;
        let peer = &self.peer;
        let frames = &frames;
        if self.streams.len() == 1 || nframes == 1 {
            let w = &mut self.streams[0];
            for i in 0..nframes {
                send_one(w, frames.get(i), timeout, peer).await?;
            }
        } else {
            let n = self.streams.len();
            try_join_all(
                self.streams
                    .iter_mut()
                    .enumerate()
                    .map(|(s, w)| async move {
                        let mut i = s;
                        while i < nframes {
                            send_one(w, frames.get(i), timeout, peer).await?;
                            i += n;
                        }
                        Ok::<(), TransportError>(())
                    }),
            )
            .await?;
        }
        self.poisoned = false;
        Ok(())
    }

    /// Sends one frame with an arbitrary payload on the first stream (control frames:
    /// abort, check, close).
    async fn frame(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(), TransportError> {
        if self.poisoned {
            return Err(TransportError::Poisoned {
                peer: self.peer.clone(),
            });
        }
        self.poisoned = true;
        let mut h = header;
        h.len = payload.len() as u32;
        let r = tokio::time::timeout(
            timeout,
            write_frame(&mut self.streams[0], &h.encode(), payload),
        )
        .await;
        match r {
            Ok(Ok(())) => {
                self.poisoned = false;
                Ok(())
            }
            Ok(Err(e)) => Err(TransportError::io(&self.peer, e)),
            Err(_) => Err(TransportError::Timeout(self.peer.clone())),
        }
    }

    /// Tells the peer we close the link on purpose, then shuts the streams down.
    async fn shut(mut self: Box<Self>, header: FrameHeader) {
        let mut h = header;
        h.kind = FrameKind::Close;
        for w in self.streams.iter_mut() {
            if !self.poisoned {
                let _ = tokio::time::timeout(
                    Duration::from_millis(200),
                    write_frame(w, &h.encode(), &[]),
                )
                .await;
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), w.shutdown()).await;
        }
        if let Some(g) = self.guard.take() {
            g.done_sending();
            if tokio::time::timeout(CLOSE_WAIT, g.closed()).await.is_err() {
                tracing::debug!(target: "eccl::net", "link to {}: the peer did not finish its side within {CLOSE_WAIT:?}", self.peer);
            }
        }
    }
}

async fn send_one(
    w: &mut BoxWrite,
    (h, part): (FrameHeader, &[u8]),
    timeout: Duration,
    peer: &str,
) -> Result<(), TransportError> {
    match tokio::time::timeout(timeout, write_frame(w, &h.encode(), part)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(TransportError::io(peer, e)),
        Err(_) => Err(TransportError::Timeout(peer.to_string())),
    }
}

/// Writes header and payload with as few system calls as the socket allows, then
/// flushes: free on a TCP socket, but a TLS stream may otherwise keep the frame's last
/// records in its buffer until something else is written, which may be never.
async fn write_frame(
    w: &mut BoxWrite,
    header: &[u8; FRAME_HEADER_LEN],
    payload: &[u8],
) -> std::io::Result<()> {
    let mut h: &[u8] = header;
    let mut p = payload;
    while !h.is_empty() {
        let n = w
            .write_vectored(&[IoSlice::new(h), IoSlice::new(p)])
            .await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        if n < h.len() {
            h = &h[n..];
        } else {
            p = &p[n - h.len()..];
            h = &[];
        }
    }
    w.write_all(p).await?;
    w.flush().await
}

/// Receiving half of a stream link: frames from every stream, merged.
pub(crate) struct StreamRx {
    events: mpsc::Receiver<LinkEvent>,
    readers: Vec<tokio::task::JoinHandle<()>>,
    peer: String,
    /// Whatever carries the streams, kept as long as the link (a QUIC connection).
    _guard: Option<Arc<dyn LinkGuard>>,
}

impl StreamRx {
    /// Next event; `None` once every reader has stopped and all events were taken.
    async fn wait(&mut self) -> Option<LinkEvent> {
        self.events.recv().await
    }

    /// A ready event, without waiting.
    fn ready(&mut self) -> Option<LinkEvent> {
        crate::link::ready_now(&mut self.events)
    }
}

impl SendHalf for StreamTx {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    fn send_region<'a>(
        &'a mut self,
        header: FrameHeader,
        payload: &'a [u8],
        frame_bytes: usize,
        align: usize,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.region(header, payload, frame_bytes, align, timeout))
    }

    fn send_frame<'a>(
        &'a mut self,
        header: FrameHeader,
        payload: &'a [u8],
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.frame(header, payload, timeout))
    }

    fn close(self: Box<Self>, header: FrameHeader) -> BoxFuture<'static, ()> {
        Box::pin(self.shut(header))
    }

    fn window_stats(&self) -> Option<super::tcp_info::WindowStats> {
        super::tcp_info::read_all(&self.tcp_fds)
    }
}

impl RecvHalf for StreamRx {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn next(&mut self) -> BoxFuture<'_, Option<LinkEvent>> {
        Box::pin(self.wait())
    }

    fn try_next(&mut self) -> Option<LinkEvent> {
        self.ready()
    }
}

impl Drop for StreamRx {
    fn drop(&mut self) {
        for r in &self.readers {
            r.abort();
        }
    }
}

/// Builds a link from already authenticated byte streams (one or more, same order on
/// both sides). Spawns one reader task per stream on the current tokio runtime. `guard`
/// is what carries the streams, if their end must be orderly (see [`LinkGuard`]).
/// `tcp_fds`: the streams' TCP sockets, if they are TCP connections (held open by the
/// streams), for [`LinkTx::window_stats`]; empty otherwise.
pub fn link_from_streams<R, W>(
    peer: String,
    transport: Transport,
    streams: Vec<(R, W)>,
    tcp_fds: Vec<std::os::fd::RawFd>,
    observer: Arc<dyn LinkObserver>,
    keep_buf_max: usize,
    guard: Option<Arc<dyn LinkGuard>>,
) -> (LinkTx, LinkRx)
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    let (tx, rx) = mpsc::channel(POOL_FRAMES * streams.len() + 4);
    let mut writers: Vec<BoxWrite> = Vec::new();
    let mut readers = Vec::new();
    let live = Arc::new(AtomicUsize::new(streams.len()));
    for (r, w) in streams {
        writers.push(Box::new(w));
        let ctx = ReaderCtx {
            pool: Pool::new(POOL_FRAMES, keep_buf_max),
            tx: tx.clone(),
            observer: observer.clone(),
            peer: peer.clone(),
            live: live.clone(),
            guard: guard.clone(),
        };
        readers.push(tokio::spawn(read_loop(Box::new(r), ctx)));
    }
    let tx = StreamTx {
        streams: writers,
        tcp_fds,
        peer: peer.clone(),
        guard: guard.clone(),
        poisoned: false,
    };
    let rx = StreamRx {
        events: rx,
        readers,
        peer,
        _guard: guard,
    };
    (LinkTx::new(tx, transport), LinkRx::new(rx))
}

struct ReaderCtx {
    pool: Arc<Pool>,
    tx: mpsc::Sender<LinkEvent>,
    observer: Arc<dyn LinkObserver>,
    peer: String,
    /// Readers of this link still running.
    live: Arc<AtomicUsize>,
    guard: Option<Arc<dyn LinkGuard>>,
}

async fn read_loop(mut r: BoxRead, ctx: ReaderCtx) {
    let ReaderCtx {
        pool,
        tx,
        observer,
        peer,
        live,
        guard,
    } = ctx;
    let fail = |e: TransportError| async {
        let last = live.fetch_sub(1, Ordering::AcqRel) == 1;
        // A clean end of one stream says nothing about frames still travelling on the
        // others: only the last stream to end reports it, after everything was
        // delivered. A broken stream is reported at once.
        if matches!(e, TransportError::Closed { .. }) && !last {
            return;
        }
        if last {
            if let Some(g) = &guard {
                g.drained();
            }
        }
        observer.on_failure(&peer, &e);
        let _ = tx.send(LinkEvent::Failed(Arc::new(e))).await;
    };
    loop {
        let mut hb = [0u8; FRAME_HEADER_LEN];
        if let Err(e) = r.read_exact(&mut hb).await {
            return fail(TransportError::io(&peer, e)).await;
        }
        let header = match FrameHeader::decode(&hb) {
            Ok(h) => h,
            Err(e) => {
                return fail(TransportError::Header {
                    peer: peer.clone(),
                    source: e,
                })
                .await
            }
        };
        if header.kind == FrameKind::Close {
            return fail(TransportError::Closed { peer: peer.clone() }).await;
        }
        tracing::trace!(target: "eccl::net", "link from {peer}: read {:?} #{} message {} ({} B){}", header.kind, header.seq, header.index, header.len, if pool.is_exhausted() { "; every receive buffer is in use: waiting for one" } else { "" });
        let mut payload = pool.get(header.len as usize).await;
        if let Err(e) = r.read_exact(payload.as_bytes_mut()).await {
            return fail(TransportError::io(&peer, e)).await;
        }
        if header.kind == FrameKind::Abort {
            let reason = String::from_utf8_lossy(payload.as_bytes()).into_owned();
            observer.on_abort(&peer, &header, &reason);
            continue;
        }
        let payload = Payload::Pooled(payload);
        if tx
            .send(LinkEvent::Frame(Incoming { header, payload }))
            .await
            .is_err()
        {
            return; // the receiving half is gone
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::test_util::{data_header as header, Seen};

    async fn pair() -> (LinkTx, LinkRx, tokio::io::DuplexStream, Arc<Seen>) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (ar, aw) = tokio::io::split(a);
        let seen = Arc::new(Seen::default());
        let (tx, rx) = link_from_streams(
            "peer".into(),
            Transport::Tcp,
            vec![(ar, aw)],
            vec![],
            seen.clone(),
            1 << 20,
            None,
        );
        (tx, rx, b, seen)
    }

    #[tokio::test]
    async fn frames_round_trip_in_pieces() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (ar, aw) = tokio::io::split(a);
        let (br, bw) = tokio::io::split(b);
        let seen = Arc::new(Seen::default());
        let (mut tx, _rx_a) = link_from_streams(
            "b".into(),
            Transport::Tcp,
            vec![(ar, aw)],
            vec![],
            seen.clone(),
            1 << 20,
            None,
        );
        let (_tx_b, mut rx) = link_from_streams(
            "a".into(),
            Transport::Tcp,
            vec![(br, bw)],
            vec![],
            seen,
            1 << 20,
            None,
        );
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let send = tx.send_region(header(0), &data, 4096, 4, Duration::from_secs(5));
        let recv = async {
            let mut got = vec![0u8; data.len()];
            let mut n = 0;
            while n < data.len() {
                match rx.next().await {
                    Some(LinkEvent::Frame(f)) => {
                        let off = f.header.offset as usize;
                        got[off..off + f.payload.len()].copy_from_slice(f.payload.as_bytes());
                        n += f.payload.len();
                    }
                    _ => panic!("link failed"),
                }
            }
            got
        };
        let (s, got) = tokio::join!(send, recv);
        s.unwrap();
        assert_eq!(got, data);
    }

    #[tokio::test]
    async fn garbage_header_fails_the_link() {
        let (_tx, mut rx, mut remote, seen) = pair().await;
        remote.write_all(&[0x42; FRAME_HEADER_LEN]).await.unwrap();
        match rx.next().await {
            Some(LinkEvent::Failed(e)) => {
                assert!(matches!(*e, TransportError::Header { .. }), "{e}")
            }
            _ => panic!("expected a failure"),
        }
        assert_eq!(seen.0.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn oversized_frame_fails_the_link_without_allocating() {
        let (_tx, mut rx, mut remote, _) = pair().await;
        let mut h = header(0).encode();
        h[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
        remote.write_all(&h).await.unwrap();
        match rx.next().await {
            Some(LinkEvent::Failed(e)) => assert!(e.to_string().contains("exceeds"), "{e}"),
            _ => panic!("expected a failure"),
        }
    }

    #[tokio::test]
    async fn truncated_frame_and_abort_frames() {
        let (_tx, mut rx, mut remote, seen) = pair().await;
        let mut h = header(5);
        h.kind = FrameKind::Abort;
        remote.write_all(&h.encode()).await.unwrap();
        remote.write_all(b"boom!").await.unwrap();
        remote.write_all(&header(100).encode()).await.unwrap();
        remote.write_all(&[1, 2, 3]).await.unwrap();
        drop(remote);
        match rx.next().await {
            Some(LinkEvent::Failed(e)) => {
                assert!(matches!(*e, TransportError::Closed { .. }), "{e}")
            }
            _ => panic!("expected a failure"),
        }
        let seen = seen.0.lock().unwrap();
        assert_eq!(seen[0], "abort boom!");
    }
}
