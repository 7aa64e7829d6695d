//! Shared memory between two peers of one host, after NCCL's SHM transport: the sender
//! copies a frame into a slot of a ring in memory both processes map, the receiver reads
//! (and reduces from) the slot where it lies and releases it. One copy per hop, and no
//! system call per frame while both sides keep up.
//!
//! - **Set-up.** The dialer connects to the acceptor's abstract unix socket (nothing on
//!   the filesystem), both authenticate with the job secret, and the dialer passes a
//!   sealed memfd and four eventfds with `SCM_RIGHTS`. Nothing is left behind when any
//!   process dies: the memory goes with the last descriptor.
//! - **Waiting** never burns a core for long: a side that finds nothing to do spins for
//!   a little (see [`crate::spin::plan_spin`]), then sets its `waiting` flag and sleeps on an eventfd, which the other
//!   side writes only when it sees the flag (a Dekker-style exchange on `SeqCst`
//!   atomics, so no wake-up is lost).
//! - **Liveness.** A segment does not close when its owner dies, so the unix socket
//!   stays open as the link's liveness channel: a dead peer's socket reaches EOF, which
//!   fails the link after the frames it published are read. The socket also carries
//!   `Abort` and `Close` frames, seen at once by a watcher task whatever the executor
//!   waits on. A peer process that forked (a DataLoader's workers) left copies of the
//!   socket in its children, so the socket may outlive it: the pidfd of the process the
//!   kernel names as the socket's other end ends the link too. A stopped peer is the
//!   master's to catch (its lease), like on every transport.

mod fds;
use eccl_shm as segment;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use eccl_protocol::frame::{FrameHeader, FrameKind, FRAME_HEADER_LEN};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::Notify;

use futures::future::BoxFuture;

use crate::link::{
    Frames, Incoming, LinkEvent, LinkObserver, LinkRx, LinkTx, Loan, Payload, RecvHalf, SendHalf,
    Transport,
};
use crate::TransportError;
pub(crate) use segment::Geometry;
use segment::{Mapping, Peek, NSLOTS};

/// Refuses a local connection from (or to) a process of another user: the abstract
/// socket has no file permissions, so any local user can reach it, and the job secret's
/// handshake would then be all that stands between another user of the host and the
/// job's memory. Checked before anything is read or sent.
pub fn check_same_user(stream: &UnixStream, peer: &str) -> Result<(), TransportError> {
    let cred = stream
        .peer_cred()
        .map_err(|e| TransportError::io(peer, e))?;
    let me = nix::unistd::geteuid().as_raw();
    if cred.uid() != me {
        return Err(TransportError::BadHello {
            peer: peer.to_string(),
            reason: format!(
                "a process of user {} on the shm socket of user {me}: only the job's own user may connect",
                cred.uid()
            ),
        });
    }
    Ok(())
}

/// The slot size for frames of `frame_bytes`: whole pages, at least a shared-state chunk.
pub fn slot_bytes(frame_bytes: usize) -> usize {
    frame_bytes
        .clamp(segment::MIN_SLOT, segment::MAX_SLOT)
        .div_ceil(4096)
        * 4096
}

/// Link state as the watcher sees the unix socket.
struct Liveness {
    /// 0 up, 1 closed on purpose, 2 failed.
    state: AtomicU8,
    error: Mutex<Option<Arc<TransportError>>>,
    notify: Notify,
}

impl Liveness {
    fn down(&self, error: TransportError, closed: bool) {
        self.down_with(Arc::new(error), closed)
    }

    fn down_with(&self, error: Arc<TransportError>, closed: bool) {
        if let Ok(mut e) = self.error.lock() {
            e.get_or_insert(error);
        }
        self.state
            .store(if closed { 1 } else { 2 }, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    fn error(&self) -> Option<Arc<TransportError>> {
        if self.state.load(Ordering::SeqCst) == 0 {
            return None;
        }
        self.error.lock().ok().and_then(|e| e.clone())
    }
}

/// What both halves of a link share.
struct Shared {
    map: Mapping,
    peer: String,
    live: Arc<Liveness>,
    /// Wakes the peer's receiver of our sending ring, and the peer's sender of our
    /// receiving ring (when a slot is released).
    wake_reader: OwnedFd,
    wake_writer: OwnedFd,
    watcher: tokio::task::JoinHandle<()>,
    /// The slots of the receiving ring this process holds (taken, not yet released): a
    /// frame the peer publishes into one of them breaks the protocol, and taking it
    /// would hand out a second mutable view of memory a `Slot` still lends.
    held: [std::sync::atomic::AtomicBool; segment::NSLOTS],
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

/// Why a wait ended without what it waited for.
enum WaitEnd {
    Down(Arc<TransportError>),
    Timeout,
}

/// Spins, then sleeps on `fd` (with `flag` raised) until `ready()` holds, the link goes
/// down, or `deadline` passes.
async fn wait_for(
    ready: impl Fn() -> bool,
    flag: &std::sync::atomic::AtomicU32,
    fd: &AsyncFd<OwnedFd>,
    live: &Liveness,
    deadline: Option<tokio::time::Instant>,
) -> Result<(), WaitEnd> {
    if crate::spin::spin_until(&ready, false) {
        return Ok(());
    }
    loop {
        let notified = live.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        flag.store(1, Ordering::SeqCst);
        if ready() {
            flag.store(0, Ordering::SeqCst);
            return Ok(());
        }
        if let Some(e) = live.error() {
            flag.store(0, Ordering::SeqCst);
            return Err(WaitEnd::Down(e));
        }
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = fd.readable() => {
                if let Ok(mut guard) = r {
                    fds::drain(fd.get_ref().as_raw_fd());
                    guard.clear_ready();
                }
            }
            _ = &mut notified => {}
            _ = sleep => {
                flag.store(0, Ordering::SeqCst);
                return Err(WaitEnd::Timeout);
            }
        }
        flag.store(0, Ordering::SeqCst);
    }
}

/// Sending half: writes frames into the ring the peer reads.
pub(crate) struct ShmTx {
    shared: Arc<Shared>,
    ring: usize,
    next: u64,
    space: AsyncFd<OwnedFd>,
    control: OwnedWriteHalf,
}

impl ShmTx {
    fn err_down(&self, e: Arc<TransportError>) -> TransportError {
        match &*e {
            TransportError::Closed { .. } => TransportError::Closed {
                peer: self.shared.peer.clone(),
            },
            other => TransportError::Io {
                peer: self.shared.peer.clone(),
                source: std::io::Error::other(other.to_string()),
            },
        }
    }

    /// Publishes one frame: waits for the next slot to be free, copies `data` into it,
    /// writes the header and moves the ring's head.
    async fn publish(
        &mut self,
        mut header: FrameHeader,
        data: &[u8],
        timeout: Duration,
    ) -> Result<(), TransportError> {
        let map = &self.shared.map;
        if data.len() > map.geometry().slot_bytes {
            return Err(TransportError::Io {
                peer: self.shared.peer.clone(),
                source: std::io::Error::other(format!(
                    "a {}-byte frame does not fit a {}-byte slot",
                    data.len(),
                    map.geometry().slot_bytes
                )),
            });
        }
        let (ring, next) = (self.ring, self.next);
        // (`slot_free` loads SeqCst: see the receiver's `ready` in `ShmRx::wait`.)
        let free = || map.slot_free(ring, next);
        if !free() {
            let deadline = tokio::time::Instant::now() + timeout;
            let flag = map.writer_waiting(self.ring);
            match wait_for(free, flag, &self.space, &self.shared.live, Some(deadline)).await {
                Ok(()) => {}
                Err(WaitEnd::Down(e)) => return Err(self.err_down(e)),
                Err(WaitEnd::Timeout) => {
                    return Err(TransportError::Timeout(self.shared.peer.clone()))
                }
            }
        }
        if let Some(e) = self.shared.live.error() {
            return Err(self.err_down(e));
        }
        header.len = data.len() as u32;
        // From here to the head's move nothing awaits: a cancelled send never leaves a
        // half-written frame published.
        // SAFETY: this `ShmTx` is the ring's only sender in this process (the halves are
        // made once per link and not cloned), `self.next` counts what it published, and
        // `data` fits a slot (checked above).
        if !unsafe { map.try_publish(self.ring, self.next, &header.encode(), data) } {
            // Only the sender marks a slot busy, so a slot seen free stays free.
            return Err(TransportError::Io {
                peer: self.shared.peer.clone(),
                source: std::io::Error::other("a free slot was taken under its sender"),
            });
        }
        self.next += 1;
        if map.reader_waiting(self.ring).load(Ordering::SeqCst) != 0 {
            fds::signal(&self.shared.wake_reader);
        }
        Ok(())
    }

    async fn region(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        frame_bytes: usize,
        align: usize,
        timeout: Duration,
    ) -> Result<(), TransportError> {
        let slot = self.shared.map.geometry().slot_bytes;
        for (h, part) in Frames::new(header, payload, frame_bytes, align, slot).iter() {
            self.publish(h, part, timeout).await?;
        }
        Ok(())
    }

    /// `Abort` and `Close` go over the unix socket, where the peer's watcher sees them
    /// at once; every other frame goes through the ring.
    async fn frame(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(), TransportError> {
        match header.kind {
            FrameKind::Abort | FrameKind::Close => {
                let mut h = header;
                h.len = payload.len() as u32;
                let write = async {
                    self.control.write_all(&h.encode()).await?;
                    self.control.write_all(payload).await
                };
                match tokio::time::timeout(timeout, write).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(TransportError::io(&self.shared.peer, e)),
                    Err(_) => Err(TransportError::Timeout(self.shared.peer.clone())),
                }
            }
            _ => self.publish(header, payload, timeout).await,
        }
    }

    async fn shut(mut self: Box<Self>, header: FrameHeader) {
        let mut h = header;
        h.kind = FrameKind::Close;
        let _ = self.frame(h, &[], Duration::from_millis(200)).await;
        let _ = tokio::time::timeout(Duration::from_millis(200), self.control.shutdown()).await;
    }
}

/// Receiving half: reads frames from the ring the peer writes.
pub(crate) struct ShmRx {
    shared: Arc<Shared>,
    ring: usize,
    next: u64,
    data: AsyncFd<OwnedFd>,
    /// The failure was reported; nothing more comes.
    done: bool,
}

/// A received frame's slot. Dropping it hands the slot back to the sender.
pub struct Slot {
    shared: Arc<Shared>,
    ring: usize,
    index: usize,
    len: usize,
}

impl Loan for Slot {
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: the receiver owns a taken slot until this `Slot` is dropped.
        unsafe { &self.shared.map.slot(self.ring, self.index)[..self.len] }
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`; `&mut self` keeps this the only view of this `Slot`,
        // and `held` keeps any other `Slot` off this index while this one lives (a peer
        // that publishes into a held slot fails the link instead).
        unsafe { &mut self.shared.map.slot(self.ring, self.index)[..self.len] }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let map = &self.shared.map;
        // Not held any more before the sender may publish into it again.
        self.shared.held[self.index].store(false, Ordering::Release);
        map.release(self.ring, self.index);
        if map.writer_waiting(self.ring).load(Ordering::SeqCst) != 0 {
            fds::signal(&self.shared.wake_writer);
        }
    }
}

impl ShmRx {
    fn failed(&mut self, e: TransportError) -> LinkEvent {
        self.done = true;
        // The link's error is what went wrong (the sender half reports it too), not a
        // clean close.
        let e = Arc::new(e);
        self.shared.live.down_with(e.clone(), false);
        LinkEvent::Failed(e)
    }

    /// The next published frame, if there is one.
    fn take(&mut self) -> Option<LinkEvent> {
        let map = &self.shared.map;
        let (index, raw) = match map.peek(self.ring, self.next) {
            Peek::Empty => return None,
            Peek::Overrun => {
                let peer = self.shared.peer.clone();
                return Some(self.failed(TransportError::Io {
                    peer,
                    source: std::io::Error::other("the peer published past the end of the ring"),
                }));
            }
            Peek::Frame { index, header } => (index, header),
        };
        let header = match FrameHeader::decode(&raw) {
            Ok(h) if (h.len as usize) <= map.geometry().slot_bytes => h,
            Ok(h) => {
                let peer = self.shared.peer.clone();
                return Some(self.failed(TransportError::Io {
                    peer,
                    source: std::io::Error::other(format!(
                        "a frame of {} bytes in a slot of {}",
                        h.len,
                        map.geometry().slot_bytes
                    )),
                }));
            }
            Err(source) => {
                let peer = self.shared.peer.clone();
                return Some(self.failed(TransportError::Header { peer, source }));
            }
        };
        if self.shared.held[index].swap(true, Ordering::AcqRel) {
            let peer = self.shared.peer.clone();
            return Some(self.failed(TransportError::Io {
                peer,
                source: std::io::Error::other(
                    "the peer published a frame into a slot this process still holds",
                ),
            }));
        }
        self.next += 1;
        let slot = Slot {
            shared: self.shared.clone(),
            ring: self.ring,
            index,
            len: header.len as usize,
        };
        Some(LinkEvent::Frame(Incoming {
            header,
            payload: Payload::Lent(Box::new(slot)),
        }))
    }

    async fn wait(&mut self) -> Option<LinkEvent> {
        loop {
            if self.done {
                return None;
            }
            if let Some(ev) = self.take() {
                return Some(ev);
            }
            // Down, and every frame published before is taken: report it once.
            if let Some(e) = self.shared.live.error() {
                if let Some(ev) = self.take() {
                    return Some(ev);
                }
                self.done = true;
                return Some(LinkEvent::Failed(e));
            }
            let map = &self.shared.map;
            let (ring, next) = (self.ring, self.next);
            // SeqCst, as the flag's store before it in `wait_for` and the sender's
            // head store and flag load: with an Acquire load here the two sides could
            // each miss the other's write (the sender sees no waiter, this side no
            // frame) and this side would sleep through the frame.
            let ready = || map.head(ring).load(Ordering::SeqCst) > next;
            let flag = map.reader_waiting(ring);
            let _ = wait_for(ready, flag, &self.data, &self.shared.live, None).await;
        }
    }

    fn ready(&mut self) -> Option<LinkEvent> {
        if self.done {
            return None;
        }
        if let Some(ev) = self.take() {
            return Some(ev);
        }
        let e = self.shared.live.error()?;
        // A frame published just before the link went down is taken first (as `wait`
        // does): the peer's last frames come before its close.
        if let Some(ev) = self.take() {
            return Some(ev);
        }
        self.done = true;
        Some(LinkEvent::Failed(e))
    }
}

impl SendHalf for ShmTx {
    fn peer(&self) -> &str {
        &self.shared.peer
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
}

impl RecvHalf for ShmRx {
    fn peer(&self) -> &str {
        &self.shared.peer
    }

    fn next(&mut self) -> BoxFuture<'_, Option<LinkEvent>> {
        Box::pin(self.wait())
    }

    fn try_next(&mut self) -> Option<LinkEvent> {
        self.ready()
    }
}

/// Reads the unix socket until it ends: `Abort` frames go to the observer at once, a
/// `Close` or the end of the socket takes the link down. `exit` (the peer process's
/// pidfd) ends it too: a process that forked (a DataLoader's workers) leaves copies of
/// the socket in its children, so its death does not end the socket; what it wrote
/// before it died is still read first.
async fn watch(
    mut r: OwnedReadHalf,
    live: Arc<Liveness>,
    observer: Arc<dyn LinkObserver>,
    peer: String,
    exit: Option<(u32, AsyncFd<OwnedFd>)>,
) {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; FRAME_HEADER_LEN + MAX_CONTROL_REASON];
    // The peer's process ended: what the socket holds now is all it will ever hold.
    let mut ended = false;
    loop {
        while buf.len() >= FRAME_HEADER_LEN {
            let head: &[u8; FRAME_HEADER_LEN] = buf[..FRAME_HEADER_LEN]
                .try_into()
                .expect("the length was checked");
            let h = match FrameHeader::decode(head) {
                Ok(h)
                    if matches!(h.kind, FrameKind::Abort | FrameKind::Close)
                        && h.len as usize <= MAX_CONTROL_REASON =>
                {
                    h
                }
                _ => {
                    let e = TransportError::Io {
                        peer: peer.clone(),
                        source: std::io::Error::other("a bad frame on the shm control socket"),
                    };
                    observer.on_failure(&peer, &e);
                    return live.down(e, false);
                }
            };
            let used = FRAME_HEADER_LEN + h.len as usize;
            if buf.len() < used {
                break;
            }
            if h.kind == FrameKind::Close {
                return live.down(TransportError::Closed { peer }, true);
            }
            let reason = String::from_utf8_lossy(&buf[FRAME_HEADER_LEN..used]).into_owned();
            buf.drain(..used);
            observer.on_abort(&peer, &h, &reason);
        }
        if ended {
            // As the end of the socket would have: the frames it published before it
            // died are still read from the ring.
            if let Some((pid, _)) = &exit {
                tracing::info!(target: "eccl::link", "shm link to {peer}: its process {pid} ended: the link is down (a process it forked may still hold the link's socket)");
            }
            return live.down(TransportError::Closed { peer }, true);
        }
        tokio::select! {
            biased;
            n = r.read(&mut chunk) => match n {
                // The end of the socket: a partial frame is lost with its writer.
                Ok(0) => return live.down(TransportError::Closed { peer }, true),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) => {
                    let e = TransportError::io(&peer, e);
                    let closed = matches!(e, TransportError::Closed { .. });
                    if !closed {
                        observer.on_failure(&peer, &e);
                    }
                    return live.down(e, closed);
                }
            },
            () = process_ended(&exit) => {
                // Whatever it wrote before it died is in the socket's buffer now. Asked
                // of the kernel itself: tokio's `try_read` answers from the readiness it
                // last saw, which the read above may have cleared.
                let fd = r.as_ref().as_raw_fd();
                while let Ok(n) = nix::sys::socket::recv(fd, &mut chunk, nix::sys::socket::MsgFlags::MSG_DONTWAIT) {
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                ended = true;
            }
        }
    }
}

/// The longest reason an `Abort` or `Close` frame on the control socket may carry.
const MAX_CONTROL_REASON: usize = 4096;

/// A descriptor that becomes readable when the process at the other end of `stream`
/// ends: its pidfd as the socket records it (`SO_PEERPIDFD`, Linux 6.5: that very
/// process, whatever pid numbers are reused since), else one opened by its pid
/// (`pidfd_open(2)`, Linux 5.3), else `None`: an older kernel, a process this one cannot
/// see (another pid namespace gives pid 0), or one already gone (the socket's end then
/// says so).
fn peer_exit(stream: &UnixStream) -> Option<(u32, AsyncFd<OwnedFd>)> {
    let pid = stream.peer_cred().ok()?.pid()?;
    let pid = u32::try_from(pid).ok().filter(|p| *p > 0)?;
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes (one c_int) into `fd`, which lives
    // across the call; the socket is open (borrowed from `stream`).
    let got = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if got == 0 && fd >= 0 {
        // SAFETY: `fd` was just returned by the kernel: an open descriptor nobody else
        // owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        return readable(fd).ok().map(|fd| (pid, fd));
    }
    process_exit(pid)
}

/// A pidfd of process `pid`, opened by its number (see [`peer_exit`]).
fn process_exit(pid: u32) -> Option<(u32, AsyncFd<OwnedFd>)> {
    let raw = i32::try_from(pid).ok()?;
    // SAFETY: pidfd_open takes a pid and flags by value and returns a new descriptor or
    // -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
    if fd < 0 {
        tracing::debug!(target: "eccl::link", "no pidfd for process {pid}: {}", std::io::Error::last_os_error());
        return None;
    }
    // SAFETY: `fd` was just returned by pidfd_open: an open descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    readable(fd).ok().map(|fd| (pid, fd))
}

/// Waits until the process behind `exit` ends (never, without one).
async fn process_ended(exit: &Option<(u32, AsyncFd<OwnedFd>)>) {
    match exit {
        Some((_, fd)) => {
            // A pidfd reads as readable once its process has ended, for good: the
            // readiness is not cleared (the caller stops watching).
            let _ = fd.readable().await;
        }
        None => std::future::pending().await,
    }
}

/// An eventfd registered with the runtime, to sleep on until it is written.
fn readable(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the `AsyncFd` owns the `OwnedFd`, so the descriptor stays open and names
    // the same eventfd for the `AsyncFd`'s whole life.
    unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(|e| e.into_parts().1)
}

/// Builds the two halves of a link over a mapped segment. `ring` is the ring this side
/// sends on (0 for the dialer).
fn build(
    stream: UnixStream,
    map: Mapping,
    fds: fds::LinkFds,
    ring: usize,
    peer: String,
    observer: Arc<dyn LinkObserver>,
) -> std::io::Result<(LinkTx, LinkRx)> {
    let other = 1 - ring;
    let fds::LinkFds {
        segment,
        data: [d0, d1],
        space: [s0, s1],
    } = fds;
    drop(segment); // the mapping keeps the memory
    let (mut data, mut space) = ([Some(d0), Some(d1)], [Some(s0), Some(s1)]);
    let take = |v: &mut [Option<OwnedFd>; 2], i: usize| v[i].take().expect("each fd once");
    let wake_reader = take(&mut data, ring);
    let wait_data = take(&mut data, other);
    let wait_space = take(&mut space, ring);
    let wake_writer = take(&mut space, other);
    // The process at the other end of the socket (the kernel's record of who made it:
    // copies held by its children do not change it).
    let exit = peer_exit(&stream);
    let (r, w) = stream.into_split();
    let live = Arc::new(Liveness {
        state: AtomicU8::new(0),
        error: Mutex::new(None),
        notify: Notify::new(),
    });
    let watcher = tokio::spawn(watch(r, live.clone(), observer, peer.clone(), exit));
    let shared = Arc::new(Shared {
        map,
        peer,
        live,
        wake_reader,
        wake_writer,
        watcher,
        held: Default::default(),
    });
    let tx = ShmTx {
        shared: shared.clone(),
        ring,
        next: 0,
        space: readable(wait_space)?,
        control: w,
    };
    let rx = ShmRx {
        shared,
        ring: other,
        next: 0,
        data: readable(wait_data)?,
        done: false,
    };
    Ok((LinkTx::new(tx, Transport::Shm), LinkRx::new(rx)))
}

/// The set-up message: slot size and slot count, little-endian.
type Setup = [u8; 8];

fn setup_err(peer: &str, why: impl std::fmt::Display) -> TransportError {
    TransportError::BadHello {
        peer: peer.to_string(),
        reason: format!("shm set-up: {why}"),
    }
}

/// Dialer side, on an authenticated and introduced unix stream: creates the segment,
/// passes it, waits for the acceptor to have mapped it.
pub async fn dial_link(
    mut stream: UnixStream,
    frame_bytes: usize,
    peer: String,
    observer: Arc<dyn LinkObserver>,
    timeout: Duration,
) -> Result<(LinkTx, LinkRx), TransportError> {
    let geo = Geometry::new(slot_bytes(frame_bytes))
        .ok_or_else(|| setup_err(&peer, "no valid slot size"))?;
    let fds = fds::LinkFds::create(geo).map_err(|e| TransportError::io(&peer, e))?;
    let map = Mapping::map(&fds.segment, geo).map_err(|e| TransportError::io(&peer, e))?;
    let mut setup: Setup = [0; 8];
    setup[..4].copy_from_slice(&(geo.slot_bytes as u32).to_le_bytes());
    setup[4..].copy_from_slice(&(NSLOTS as u32).to_le_bytes());
    let exchange = async {
        fds::send(&stream, &setup, &fds).await?;
        let mut ack = [0u8; 1];
        stream.read_exact(&mut ack).await?;
        Ok::<_, std::io::Error>(ack[0])
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(1)) => {}
        Ok(Ok(_)) => return Err(setup_err(&peer, "the acceptor refused the segment")),
        Ok(Err(e)) => return Err(TransportError::io(&peer, e)),
        Err(_) => return Err(TransportError::Timeout(peer)),
    }
    build(stream, map, fds, 0, peer, observer).map_err(|e| TransportError::io("shm", e))
}

/// Acceptor side: receives the segment, checks and maps it, and acknowledges.
pub async fn accept_link(
    mut stream: UnixStream,
    peer: String,
    observer: Arc<dyn LinkObserver>,
    timeout: Duration,
) -> Result<(LinkTx, LinkRx), TransportError> {
    let (setup, fds) = match tokio::time::timeout(timeout, fds::recv::<8>(&stream)).await {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => return Err(setup_err(&peer, e)),
        Err(_) => return Err(TransportError::Timeout(peer)),
    };
    let slot = u32::from_le_bytes([setup[0], setup[1], setup[2], setup[3]]) as usize;
    let nslots = u32::from_le_bytes([setup[4], setup[5], setup[6], setup[7]]) as usize;
    let geo = match Geometry::new(slot).filter(|_| nslots == NSLOTS) {
        Some(g) => g,
        None => {
            let _ = stream.write_all(&[0]).await;
            return Err(setup_err(&peer, format!("{nslots} slots of {slot} bytes")));
        }
    };
    if let Err(why) = segment::check(&fds.segment, geo) {
        let _ = stream.write_all(&[0]).await;
        return Err(setup_err(&peer, why));
    }
    let map = Mapping::map(&fds.segment, geo).map_err(|e| TransportError::io(&peer, e))?;
    stream
        .write_all(&[1])
        .await
        .map_err(|e| TransportError::io(&peer, e))?;
    build(stream, map, fds, 1, peer, observer).map_err(|e| TransportError::io("shm", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::test_util::{data_header, Seen};

    /// A peer that breaks the ring's protocol (it clears the `busy` flag of a slot this
    /// side still holds, and publishes into it) fails the link: the receiver would
    /// otherwise hand out a second mutable view of memory a `Slot` still lends.
    #[tokio::test]
    async fn a_frame_published_into_a_slot_still_held_fails_the_link() {
        let geo = Geometry::new(slot_bytes(4096)).expect("a valid slot size");
        let fds = fds::LinkFds::create(geo).expect("memfd and eventfds");
        // The misbehaving peer's own mapping of the segment, as a sender of ring 0.
        let peer = Mapping::map(&fds.segment, geo).expect("map");
        let map = Mapping::map(&fds.segment, geo).expect("map");
        let (ours, _theirs) = UnixStream::pair().expect("socketpair");
        let (_tx, mut rx) =
            build(ours, map, fds, 1, "peer".into(), Arc::new(Seen::default())).expect("link");
        let h = data_header(8).encode();
        // SAFETY: the test is ring 0's only sender, counts its frames, and 8 bytes fit.
        let publish = |n: u64| unsafe { peer.try_publish(0, n, &h, &[n as u8; 8]) };
        assert!(publish(0));
        let held = match rx.try_next() {
            Some(LinkEvent::Frame(f)) => f,
            _ => panic!("frame 0 was not received"),
        };
        for n in 1..NSLOTS as u64 {
            assert!(publish(n));
            // Received and dropped at once: its slot goes back to the sender.
            assert!(
                matches!(rx.try_next(), Some(LinkEvent::Frame(_))),
                "frame {n}"
            );
        }
        // A sender that keeps the protocol waits: slot 0 is still held.
        assert!(!publish(NSLOTS as u64));
        // This one clears the flag itself and publishes into the held slot.
        peer.busy(0, 0).store(0, Ordering::SeqCst);
        assert!(publish(NSLOTS as u64));
        match rx.try_next() {
            Some(LinkEvent::Failed(e)) => {
                assert!(e.to_string().contains("still holds"), "{e}")
            }
            _ => panic!("the frame published into a held slot was received"),
        }
        assert!(rx.try_next().is_none(), "nothing after the failure");
        drop(held);
    }
}
