//! Calls in flight: [`Communicator::in_flight`] lets a caller hand the communicator
//! several calls before the first has finished and collect their outcomes later, as
//! `async_op=True` does in Python and a stream does with NCCL. The calls run in the order
//! they were submitted (every member submits the same calls in the same order, so every
//! member runs them alike); what the caller gains is that it need not wait for one call
//! before submitting the next, and that a fault ends every call in flight with an error
//! rather than leaving any waiting: the call the fault hits fails, and each one after it
//! fails fast in the epoch that failed, until the caller forms a new world.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};

use super::Communicator;
use crate::error::{Error, Result};

/// One submitted call: runs on the communicator and sends its outcome away.
type Job = Box<dyn for<'c> FnOnce(&'c mut Communicator) -> BoxFuture<'c, ()> + Send>;

/// Where the body of [`Communicator::in_flight`] submits calls. Dropping every clone
/// (the body holds the only one unless it cloned it) tells the communicator that no more
/// calls are coming.
#[derive(Clone)]
pub struct CallQueue {
    tx: mpsc::UnboundedSender<Job>,
}

/// The outcome of a submitted call, once it has run. Dropping it does not cancel the
/// call (its buffers belong to the call until it is done, as with NCCL's streams).
pub struct Queued<R> {
    rx: oneshot::Receiver<R>,
}

impl<R> Future for Queued<R> {
    type Output = Result<R>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<R>> {
        Pin::new(&mut self.rx).poll(cx).map(|r| {
            r.map_err(|_| Error::Aborted {
                epoch: 0,
                cause: "the queued call was dropped before it ran (its communicator \
                        stopped)"
                    .into(),
            })
        })
    }
}

impl CallQueue {
    /// Submits `call` to run after every call submitted before it. `call` owns what it
    /// works on (buffers move in and come back in its output).
    pub fn submit<R, F>(&self, call: F) -> Queued<R>
    where
        R: Send + 'static,
        F: for<'c> FnOnce(&'c mut Communicator) -> BoxFuture<'c, R> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |comm| {
            Box::pin(async move {
                // The caller may have stopped waiting for it; the call ran all the same.
                let _ = tx.send(call(comm).await);
            })
        });
        // The receiving end lives as long as `in_flight` runs, which outlives every
        // `CallQueue` it handed out to the body (a clone kept past the body fails here
        // and reports through `Queued`, which sees its sender dropped).
        let _ = self.tx.send(job);
        Queued { rx }
    }
}

impl Communicator {
    /// Runs `body` with a [`CallQueue`] through which it submits calls to this
    /// communicator; they run one after another, in submission order, while the body
    /// goes on (submitting more, or waiting for outcomes). Returns the body's output once
    /// the body has finished and every submitted call has run.
    ///
    /// ```no_run
    /// # async fn f(comm: &mut eccl::Communicator) -> eccl::Result<()> {
    /// use futures::FutureExt;
    /// let sums = comm
    ///     .in_flight(|q| async move {
    ///         let calls: Vec<_> = (0..4)
    ///             .map(|j| {
    ///                 q.submit(move |c| {
    ///                     async move {
    ///                         let mut v = vec![j as f32; 1024];
    ///                         c.all_reduce(&mut v, eccl::ReduceOp::Sum).await.map(|_| v)
    ///                     }
    ///                     .boxed()
    ///                 })
    ///             })
    ///             .collect();
    ///         futures::future::join_all(calls).await
    ///     })
    ///     .await;
    /// # Ok(()) }
    /// ```
    pub async fn in_flight<T, F, Fut>(&mut self, body: F) -> T
    where
        F: FnOnce(CallQueue) -> Fut,
        Fut: Future<Output = T>,
    {
        let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
        let run = async {
            while let Some(job) = rx.recv().await {
                job(self).await;
            }
        };
        // `join` drops the body's future as soon as it completes, and with it the body's
        // queue: the runner then ends once it has run what was submitted.
        let (out, ()) = futures::join!(body(CallQueue { tx }), run);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_outcome_whose_call_never_ran_is_an_error_not_a_hang() {
        let (tx, rx) = oneshot::channel::<u32>();
        drop(tx);
        let r = Queued { rx }.await;
        assert!(matches!(r, Err(Error::Aborted { .. })), "{r:?}");
    }
}
