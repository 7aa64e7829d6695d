//! Retrying over the next world after a fault: the policy, the step between attempts
//! ([`Communicator::recover`]) and helpers that wrap the loop.

use eccl_protocol::ReduceOp;

use super::{CollArgs, Communicator, OpInfo};
use crate::error::{Error, Result};
use crate::Element;

/// How the retry helpers retry.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Give up with `TooFewPeers` when fewer members remain.
    pub min_world: u32,
    /// Calls of the collective at most, the first included.
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            min_world: 1,
            max_attempts: 16,
        }
    }
}

impl Communicator {
    /// The step between attempts of a retry loop: given the error of attempt
    /// `*attempt`, either returns it (not retryable, or the last attempt) or moves to the
    /// next world with `update_topology()` and returns `Ok` for another attempt. The
    /// failed call left every input as it was (G2), so the next attempt computes over the
    /// new world's members exactly. Fails with `TooFewPeers` when the world has shrunk
    /// below `policy.min_world`.
    ///
    /// ```no_run
    /// # async fn f(comm: &mut eccl::Communicator, grads: &mut [f32]) -> eccl::Result<()> {
    /// let policy = eccl::RetryPolicy { min_world: 2, ..Default::default() };
    /// let mut attempt = 1;
    /// let info = loop {
    ///     match comm.all_reduce(grads, eccl::ReduceOp::Sum).await {
    ///         Ok(info) => break info,
    ///         Err(e) => comm.recover(e, &mut attempt, &policy).await?,
    ///     }
    /// };
    /// # let _ = info; Ok(()) }
    /// ```
    pub async fn recover(
        &mut self,
        error: Error,
        attempt: &mut u32,
        policy: &RetryPolicy,
    ) -> Result<()> {
        if !error.is_retryable() || *attempt >= policy.max_attempts {
            return Err(error);
        }
        tracing::info!(target: "eccl::coll", "attempt {attempt} failed ({error}); moving to the next world");
        *attempt += 1;
        loop {
            match self.update_topology().await {
                Ok(_) => break,
                Err(e) if e.is_retryable() && *attempt < policy.max_attempts => *attempt += 1,
                Err(e) => return Err(e),
            }
        }
        let have = self.world_size() as usize;
        let need = policy.min_world as usize;
        if have < need {
            return Err(Error::TooFewPeers { have, need });
        }
        Ok(())
    }

    /// `all_reduce` that retries over the next world after a fault (see
    /// [`Communicator::recover`]). On success `buf` holds the reduction over exactly the
    /// members in the returned [`OpInfo`].
    pub async fn all_reduce_with_retry<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        policy: &RetryPolicy,
    ) -> Result<OpInfo> {
        let mut attempt = 1;
        loop {
            match self.all_reduce(buf, op).await {
                Ok(info) => return Ok(info),
                Err(e) => self.recover(e, &mut attempt, policy).await?,
            }
        }
    }

    /// Any collective, retried over the next world after a fault.
    pub async fn collective_with_retry(
        &mut self,
        args: CollArgs,
        input: &[u8],
        output: &mut [u8],
        policy: &RetryPolicy,
    ) -> Result<OpInfo> {
        let mut attempt = 1;
        loop {
            match self.collective(args, input, output).await {
                Ok(info) => return Ok(info),
                Err(e) => self.recover(e, &mut attempt, policy).await?,
            }
        }
    }
}
