//! The verbs objects: context, protection domain, completion queue and channel, queue pair, shared
//! receive queue, address handle. Each holds the running device alive; dropping an object destroys
//! it in the engine.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use softrdma_device::{DeviceAttr, DeviceInfo, Gid, PortAttr};
use softrdma_transport::attr::QpCap;
use softrdma_transport::hca::QueuePairInfo;
use softrdma_transport::wr::UdDest;
use softrdma_transport::{
    Access, AddressVector, AsyncEvent, Counters, CqId, ModifyQp, Mtu, PdId, QpInit, QpState, QpType, RecvWr, SendWr,
    SrqId, WorkCompletion,
};
use softrdma_wire::roce::VerifyStats;
use softrdma_wire::{Psn, Qpn};

use crate::daemon::client;
use crate::error::{Error, Result};
use crate::memory::MemoryRegion;
use crate::runtime::{ChannelShared, DeviceHandle};

/// Where a device runs: in this process, or in softrdmad (see [`crate::daemon`]).
#[derive(Clone)]
pub(crate) enum Dev {
    /// The engine and I/O thread live in this process.
    Embedded(Arc<DeviceHandle>),
    /// The device belongs to softrdmad; this is our session with it.
    Daemon(Arc<client::Session>),
}

impl Dev {
    fn info(&self) -> &DeviceInfo {
        match self {
            Dev::Embedded(h) => &h.dev.info,
            Dev::Daemon(s) => &s.info,
        }
    }

    fn same(&self, o: &Dev) -> bool {
        match (self, o) {
            (Dev::Embedded(a), Dev::Embedded(b)) => Arc::ptr_eq(a, b),
            (Dev::Daemon(a), Dev::Daemon(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// An open device.
///
/// The device runs embedded (in this process) or in softrdmad ([`crate::daemon`]); every method
/// behaves the same either way.
#[derive(Clone)]
pub struct Context {
    h: Dev,
}

impl Context {
    pub(crate) fn new(h: Arc<DeviceHandle>) -> Context {
        Context { h: Dev::Embedded(h) }
    }

    pub(crate) fn daemon(s: Arc<client::Session>) -> Context {
        Context { h: Dev::Daemon(s) }
    }

    /// Whether the device belongs to softrdmad (rather than running in this process).
    pub fn is_daemon(&self) -> bool {
        matches!(self.h, Dev::Daemon(_))
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.h.info().name
    }

    /// The device description (netdev, attributes, GIDs).
    pub fn info(&self) -> &DeviceInfo {
        self.h.info()
    }

    /// Device attributes (`ibv_query_device`).
    pub fn query_device(&self) -> &DeviceAttr {
        &self.h.info().attr
    }

    /// Port attributes (`ibv_query_port`); the only port is 1.
    pub fn query_port(&self, port: u8) -> Result<&PortAttr> {
        Ok(self.h.info().port_attr(u32::from(port))?)
    }

    /// A GID (`ibv_query_gid`).
    pub fn query_gid(&self, port: u8, index: usize) -> Result<Gid> {
        Ok(self.h.info().gid(u32::from(port), index)?.gid)
    }

    /// A P_Key (`ibv_query_pkey`).
    pub fn query_pkey(&self, port: u8, index: usize) -> Result<u16> {
        let info = self.h.info();
        info.check_port(u32::from(port))?;
        info.pkeys.get(index).copied().ok_or_else(|| {
            Error::InvalidArgument(format!("P_Key index {index} out of range (the table has {})", info.pkeys.len()))
        })
    }

    /// The UDP port the device uses.
    pub fn udp_port(&self) -> u16 {
        match &self.h {
            Dev::Embedded(h) => h.dev.port.port(),
            Dev::Daemon(s) => s.udp_port,
        }
    }

    /// Allocate a protection domain. (With a daemon that refuses — its per-client object limit —
    /// the PD is invalid and every object created in it fails with `NoSuchObject`.)
    pub fn alloc_pd(&self) -> ProtectionDomain {
        match &self.h {
            Dev::Embedded(h) => {
                let id = {
                    let mut st = h.dev.lock();
                    st.next_pd += 1;
                    PdId(st.next_pd)
                };
                ProtectionDomain { h: self.h.clone(), id, _daemon: None }
            }
            Dev::Daemon(s) => match s.call_id(&softrdma_abi::msg::Request::AllocPd) {
                Ok(id) => ProtectionDomain {
                    h: self.h.clone(),
                    id: PdId(id),
                    _daemon: Some(Arc::new(client::Pd { s: Arc::clone(s), id })),
                },
                Err(_) => ProtectionDomain { h: self.h.clone(), id: PdId(0), _daemon: None },
            },
        }
    }

    /// Create a completion channel.
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        match &self.h {
            Dev::Embedded(h) => Ok(CompletionChannel {
                imp: ChannelImp::Embedded { _h: Arc::clone(h), shared: Arc::new(ChannelShared::new()?) },
            }),
            Dev::Daemon(s) => Ok(CompletionChannel { imp: ChannelImp::Daemon(client::Channel::create(s)?) }),
        }
    }

    /// Create a completion queue of `cqe` entries, optionally tied to a channel.
    pub fn create_cq(&self, cqe: u32, channel: Option<&CompletionChannel>) -> Result<CompletionQueue> {
        let max = self.h.info().attr.max_cqe;
        if cqe == 0 || cqe > max {
            return Err(Error::InvalidArgument(format!("CQ size {cqe} outside 1..={max}")));
        }
        let inner = match &self.h {
            Dev::Embedded(h) => {
                let mut st = h.dev.lock();
                let id = st.hca.create_cq(cqe);
                match channel.map(|c| &c.imp) {
                    Some(ChannelImp::Embedded { shared, .. }) => {
                        st.channels.insert(id, Arc::clone(shared));
                    }
                    Some(ChannelImp::Daemon(_)) => {
                        let _ = st.hca.destroy_cq(id);
                        return Err(Error::InvalidArgument("the channel belongs to another device".into()));
                    }
                    None => {}
                }
                CqInner::Embedded { h: Arc::clone(h), id }
            }
            Dev::Daemon(s) => {
                let ch = match channel.map(|c| &c.imp) {
                    Some(ChannelImp::Daemon(c)) if Arc::ptr_eq(&c.s, s) => Some(c.id),
                    Some(_) => return Err(Error::InvalidArgument("the channel belongs to another device".into())),
                    None => None,
                };
                CqInner::Daemon(client::Cq::create(s, cqe, ch)?)
            }
        };
        Ok(CompletionQueue { inner: Arc::new(inner), dev: self.h.clone() })
    }

    /// Wait up to `timeout` for an asynchronous event (`ibv_get_async_event`).
    pub fn get_async_event(&self, timeout: Duration) -> Option<AsyncEvent> {
        match &self.h {
            Dev::Embedded(h) => h.dev.wait_async_event(timeout),
            Dev::Daemon(s) => s.async_event(timeout),
        }
    }

    /// A file descriptor that is readable while asynchronous events are pending (what
    /// `ibv_context.async_fd` is in libibverbs): poll it, then call [`Context::get_async_event`].
    /// It stays open as long as the device runs.
    pub fn async_event_fd(&self) -> RawFd {
        match &self.h {
            Dev::Embedded(h) => h.dev.async_event_fd(),
            Dev::Daemon(s) => s.async_event_fd(),
        }
    }

    fn daemon_counters(s: &client::Session) -> Vec<(String, u64)> {
        let req = softrdma_abi::msg::Request::Stats { device: Some(s.info.name.clone()) };
        match s.call(&req, &[]) {
            Ok((softrdma_abi::msg::Response::Stats(mut v), _)) if !v.is_empty() => v.swap_remove(0).counters,
            _ => Vec::new(),
        }
    }

    /// CPU time the softrdmad device's loop has used so far (it does the device's work for every
    /// client); `None` for an embedded device, whose threads are this process's.
    pub fn device_thread_cpu(&self) -> Option<Duration> {
        match &self.h {
            Dev::Embedded(_) => None,
            Dev::Daemon(s) => Self::daemon_counters(s)
                .iter()
                .find(|(k, _)| k == "device_thread_cpu_us")
                .map(|(_, v)| Duration::from_micros(*v)),
        }
    }

    /// Engine counters (in daemon mode: the device's, all clients together).
    pub fn counters(&self) -> Counters {
        match &self.h {
            Dev::Embedded(h) => *h.dev.lock().hca.counters(),
            Dev::Daemon(s) => client::counters_from(&Self::daemon_counters(s)),
        }
    }

    /// ICRC verdicts of received packets.
    pub fn icrc_stats(&self) -> VerifyStats {
        match &self.h {
            Dev::Embedded(h) => h.dev.lock().verify,
            Dev::Daemon(s) => {
                let c = Self::daemon_counters(s);
                let get = |k: &str| c.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
                VerifyStats {
                    verified: get("icrc_verified"),
                    recovered: get("icrc_recovered_id"),
                    bad: get("icrc_errors"),
                }
            }
        }
    }

    /// UDP packets whose payload was received straight into its registered region (the
    /// continuations of RC RDMA WRITEs, see the runtime); 0 on a softrdmad device.
    pub fn rx_placed(&self) -> u64 {
        match &self.h {
            Dev::Embedded(h) => h.dev.lock().rx_placed,
            Dev::Daemon(_) => 0,
        }
    }

    /// Counters of the same-host link (shared-memory lanes to other softrdma devices on this
    /// host); in daemon mode the device's, all clients together.
    pub fn same_host_stats(&self) -> crate::SameHostStats {
        match &self.h {
            Dev::Embedded(h) => h.dev.lock().link.stats(),
            Dev::Daemon(s) => crate::SameHostStats::from_named(&Self::daemon_counters(s)),
        }
    }

    /// How this process's threads polling the device's CQs made room for the thread that answers
    /// them when both ran on one CPU (embedded: the same-host lanes' peer pollers; softrdmad: the
    /// device loop).
    pub fn poller_stats(&self) -> crate::PollerStats {
        match &self.h {
            Dev::Embedded(h) => {
                let l = h.dev.lock().link.stats();
                crate::PollerStats { shared_yields: l.poller_yields, moves: l.poller_moves }
            }
            Dev::Daemon(s) => s.poller_stats(),
        }
    }

    /// Posts whose packets did not leave at once but waited for the next progress, to go out
    /// batched with later ones (the QP had packets unacknowledged: see `Device::run_post`); 0 on a
    /// softrdmad device, whose daemon batches on its side.
    pub fn corked_posts(&self) -> u64 {
        match &self.h {
            Dev::Embedded(h) => h.dev.lock().corked,
            Dev::Daemon(_) => 0,
        }
    }

    /// Polls of a CQ that handed a received request's completion over before sending its ACK, left
    /// to the next flush (see `Device::poll_progress`); 0 on a softrdmad device.
    pub fn flushes_left_owed(&self) -> u64 {
        match &self.h {
            Dev::Embedded(h) => h.dev.lock().flushes_left_owed,
            Dev::Daemon(_) => 0,
        }
    }

    /// The embedded device behind this context (for the CM's IDs); an error on a softrdmad device.
    pub(crate) fn embedded(&self) -> Result<&Arc<DeviceHandle>> {
        match &self.h {
            Dev::Embedded(h) => Ok(h),
            Dev::Daemon(_) => {
                Err(Error::InvalidArgument("not an embedded device (this one belongs to softrdmad)".into()))
            }
        }
    }

    /// The softrdmad session behind this context, if the device is the daemon's.
    pub(crate) fn daemon_session(&self) -> Option<&Arc<client::Session>> {
        match &self.h {
            Dev::Daemon(s) => Some(s),
            Dev::Embedded(_) => None,
        }
    }

    /// Create an RDMA CM ID on this device (`rdma_create_id`), reporting to `channel`. On a
    /// softrdmad device the ID lives in the daemon's CM (owned by this context's session).
    pub fn create_cm_id(
        &self,
        channel: &crate::cm::CmEventChannel,
        ps: softrdma_cm::PortSpace,
    ) -> Result<crate::cm::CmId> {
        match &self.h {
            Dev::Embedded(h) => Ok(crate::cm::CmId::create(Arc::clone(h), channel, ps)),
            Dev::Daemon(s) => crate::cm::CmId::create_daemon(s, channel, ps),
        }
    }

    /// Memory regions currently registered (in daemon mode: on the device, all clients together).
    pub fn mr_count(&self) -> usize {
        match &self.h {
            Dev::Embedded(h) => h.dev.lock().mem.len(),
            Dev::Daemon(s) => {
                Self::daemon_counters(s).iter().find(|(n, _)| n == "engine_mrs").map_or(0, |(_, v)| *v as usize)
            }
        }
    }
}

/// A protection domain.
pub struct ProtectionDomain {
    h: Dev,
    id: PdId,
    _daemon: Option<Arc<client::Pd>>,
}

/// Attributes for creating a queue pair.
pub struct QpInitAttr<'a> {
    /// Transport.
    pub qp_type: QpType,
    /// CQ for send completions.
    pub send_cq: &'a CompletionQueue,
    /// CQ for receive completions.
    pub recv_cq: &'a CompletionQueue,
    /// Shared receive queue.
    pub srq: Option<&'a SharedReceiveQueue>,
    /// Capacities.
    pub cap: QpCap,
    /// Signal every send WR.
    pub sq_sig_all: bool,
}

/// Attributes of an address handle (`ibv_ah_attr` with a GRH, as RoCE needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AhAttr {
    /// Destination GID.
    pub dgid: Gid,
    /// Local GID index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label.
    pub flow_label: u32,
    /// Port (1).
    pub port: u8,
}

impl AhAttr {
    /// An address vector to `dgid` from local GID `sgid_index`.
    pub fn new(dgid: Gid, sgid_index: u8) -> AhAttr {
        AhAttr { dgid, sgid_index, hop_limit: 64, traffic_class: 0, flow_label: 0, port: 1 }
    }
}

impl ProtectionDomain {
    /// Register `len` bytes of fresh, zeroed, pinned memory with `access`.
    ///
    /// On a softrdmad device the memory is a sealed memfd mapped both here and in the daemon, which
    /// copies to and from it directly (no system call per access). Being a shared mapping, it stays
    /// shared with a child after `fork` rather than copied on write.
    pub fn reg_mr(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        MemoryRegion::register(self.h.clone(), self.id, len, access)
    }

    /// Register memory the caller owns (the C ABI's `ibv_reg_mr`).
    ///
    /// # Safety
    /// `[ptr, ptr+len)` must be valid, writable memory that stays allocated until the region is
    /// dropped; the device accesses it concurrently, as a NIC does by DMA (see
    /// [`MemoryRegion`]'s docs).
    pub unsafe fn reg_mr_raw(&self, ptr: *mut u8, len: usize, access: Access) -> Result<MemoryRegion> {
        // SAFETY: forwarded from this function's contract.
        unsafe { MemoryRegion::register_raw(self.h.clone(), self.id, ptr, len, access) }
    }

    /// Create a queue pair (in RESET).
    pub fn create_qp(&self, attr: &QpInitAttr<'_>) -> Result<QueuePair> {
        let a = &self.h.info().attr;
        let c = &attr.cap;
        if c.max_send_wr > a.max_qp_wr || c.max_recv_wr > a.max_qp_wr {
            return Err(Error::InvalidArgument(format!("queue depth above max_qp_wr {}", a.max_qp_wr)));
        }
        if c.max_send_sge > a.max_sge || c.max_recv_sge > a.max_sge {
            return Err(Error::InvalidArgument(format!("SGE count above max_sge {}", a.max_sge)));
        }
        for cq in [attr.send_cq, attr.recv_cq] {
            if !cq.dev.same(&self.h) {
                return Err(Error::InvalidArgument("the CQ belongs to another device".into()));
            }
        }
        if attr.srq.is_some_and(|s| !s.dev.same(&self.h)) {
            return Err(Error::InvalidArgument("the SRQ belongs to another device".into()));
        }
        let imp = match &self.h {
            Dev::Embedded(h) => {
                let init = QpInit {
                    qp_type: attr.qp_type,
                    pd: self.id,
                    send_cq: attr.send_cq.inner.id(),
                    recv_cq: attr.recv_cq.inner.id(),
                    srq: attr.srq.map(|s| s.inner.id()),
                    cap: attr.cap,
                    sq_sig_all: attr.sq_sig_all,
                };
                let qpn = h.dev.lock().hca.create_qp(init)?;
                QpImp::Embedded { h: Arc::clone(h), qpn }
            }
            Dev::Daemon(s) => QpImp::Daemon(client::Qp::create(
                s,
                self.id.0,
                attr.qp_type,
                attr.send_cq.inner.id().0,
                attr.recv_cq.inner.id().0,
                attr.srq.map(|s| s.inner.id().0),
                attr.cap,
                attr.sq_sig_all,
            )?),
        };
        let qpn = match &imp {
            QpImp::Embedded { qpn, .. } => *qpn,
            QpImp::Daemon(q) => q.qpn,
        };
        Ok(QueuePair {
            imp,
            h: self.h.clone(),
            qpn,
            qp_type: attr.qp_type,
            _send_cq: Arc::clone(&attr.send_cq.inner),
            _recv_cq: Arc::clone(&attr.recv_cq.inner),
            _srq: attr.srq.map(|s| Arc::clone(&s.inner)),
        })
    }

    /// Create a shared receive queue.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<SharedReceiveQueue> {
        let a = &self.h.info().attr;
        if max_wr == 0 || max_wr > a.max_srq_wr || max_sge > a.max_srq_sge {
            return Err(Error::InvalidArgument(format!(
                "SRQ of {max_wr} WRs x {max_sge} SGEs exceeds max_srq_wr {} / max_srq_sge {}",
                a.max_srq_wr, a.max_srq_sge
            )));
        }
        let inner = match &self.h {
            Dev::Embedded(h) => {
                let id = h.dev.lock().hca.create_srq(max_wr, max_sge);
                SrqInner::Embedded { h: Arc::clone(h), id }
            }
            Dev::Daemon(s) => SrqInner::Daemon(client::Srq::create(s, self.id.0, max_wr, max_sge)?),
        };
        Ok(SharedReceiveQueue { inner: Arc::new(inner), dev: self.h.clone() })
    }

    /// Create an address handle; the source GID index must exist.
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        let av = av_from(&self.h, attr)?;
        Ok(AddressHandle { av })
    }
}

fn av_from(h: &Dev, attr: &AhAttr) -> Result<AddressVector> {
    h.info().gid(u32::from(attr.port), usize::from(attr.sgid_index))?;
    Ok(AddressVector {
        dgid: attr.dgid.0,
        sgid_index: attr.sgid_index,
        hop_limit: attr.hop_limit,
        traffic_class: attr.traffic_class,
        flow_label: attr.flow_label,
        dlid: 0,
        sl: 0,
    })
}

enum CqInner {
    Embedded { h: Arc<DeviceHandle>, id: CqId },
    Daemon(client::Cq),
}

impl CqInner {
    fn id(&self) -> CqId {
        match self {
            CqInner::Embedded { id, .. } => *id,
            CqInner::Daemon(c) => CqId(c.id),
        }
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        if let CqInner::Embedded { h, id } = self {
            let mut st = h.dev.lock();
            st.channels.remove(id);
            let _ = st.hca.destroy_cq(*id);
        }
    }
}

/// A completion queue.
pub struct CompletionQueue {
    inner: Arc<CqInner>,
    dev: Dev,
}

impl CompletionQueue {
    /// This CQ's handle, as reported by [`CompletionChannel::get_cq_event`].
    pub fn handle(&self) -> u32 {
        self.inner.id().0
    }

    /// Move up to `max` completions into `out`; returns how many. An empty CQ first makes the
    /// device progress (receive, time out, send) on this thread, so busy polling does not wait for
    /// the I/O thread; the ACK of a request whose completion it returns may wait for this thread's
    /// next post or poll (see `Device::poll_progress`).
    ///
    /// In daemon mode this reads the CQ's ring in shared memory: no system call.
    pub fn poll(&self, max: usize, out: &mut Vec<WorkCompletion>) -> Result<usize> {
        let (h, id) = match &*self.inner {
            CqInner::Embedded { h, id } => (h, *id),
            CqInner::Daemon(c) => return c.poll(max, out),
        };
        let dev = &h.dev;
        let mut st = dev.lock();
        dev.app_returns(&mut st, true);
        let start = out.len();
        let n = st.hca.poll_cq(id, max, out)?;
        if n > 0 || max == 0 {
            if n > 0 {
                dev.poll_leaves(&mut st, id, &out[start..]);
                dev.poll_found();
            }
            return Ok(n);
        }
        let (now, work, peer_here) = dev.poll_progress(&mut st, id);
        let n = st.hca.poll_cq(id, max, out)?;
        dev.poll_leaves(&mut st, id, &out[start..]);
        drop(st);
        if n > 0 || work {
            dev.poll_found();
        } else {
            dev.poll_empty(now, peer_here);
        }
        Ok(n)
    }

    /// Ask for a channel event on the next completion (solicited or error only if `solicited_only`).
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        match &*self.inner {
            CqInner::Embedded { h, id } => Ok(h.dev.lock().hca.req_notify_cq(*id, solicited_only)?),
            CqInner::Daemon(c) => {
                c.req_notify(solicited_only);
                Ok(())
            }
        }
    }
}

/// A completion channel: blocking waits, and a file descriptor readable while events are pending.
pub struct CompletionChannel {
    imp: ChannelImp,
}

enum ChannelImp {
    Embedded { _h: Arc<DeviceHandle>, shared: Arc<ChannelShared> },
    Daemon(client::Channel),
}

impl CompletionChannel {
    /// Wait for a CQ event (up to `timeout`, or forever with `None`); returns the CQ's handle.
    pub fn get_cq_event(&self, timeout: Option<Duration>) -> Option<u32> {
        let shared = match &self.imp {
            ChannelImp::Embedded { shared, .. } => shared,
            ChannelImp::Daemon(c) => return c.get_cq_event(timeout),
        };
        let q = shared.queue.lock().expect("channel lock");
        let mut q = match timeout {
            Some(t) => shared.cv.wait_timeout_while(q, t, |q| q.is_empty()).expect("channel lock").0,
            None => shared.cv.wait_while(q, |q| q.is_empty()).expect("channel lock"),
        };
        let cq = q.pop_front()?;
        let mut b = [0u8; 1];
        let _ = shared.rx.recv(&mut b);
        Some(cq.0)
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        match &self.imp {
            ChannelImp::Embedded { shared, .. } => shared.rx.as_raw_fd(),
            ChannelImp::Daemon(c) => c.rx.as_raw_fd(),
        }
    }
}

enum SrqInner {
    Embedded { h: Arc<DeviceHandle>, id: SrqId },
    Daemon(client::Srq),
}

impl SrqInner {
    fn id(&self) -> SrqId {
        match self {
            SrqInner::Embedded { id, .. } => *id,
            SrqInner::Daemon(s) => SrqId(s.id),
        }
    }
}

impl Drop for SrqInner {
    fn drop(&mut self) {
        if let SrqInner::Embedded { h, id } = self {
            let _ = h.dev.lock().hca.destroy_srq(*id);
        }
    }
}

/// A shared receive queue.
pub struct SharedReceiveQueue {
    inner: Arc<SrqInner>,
    dev: Dev,
}

impl SharedReceiveQueue {
    /// This SRQ's handle, as [`AsyncEvent::SrqLimitReached`] reports it.
    pub fn handle(&self) -> u32 {
        self.inner.id().0
    }

    /// Post a receive.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        match &*self.inner {
            SrqInner::Embedded { h, id } => Ok(h.dev.lock().hca.post_srq_recv(*id, wr)?),
            SrqInner::Daemon(s) => s.post_recv(&wr),
        }
    }

    /// Arm the limit event: it fires when fewer than `limit` WQEs remain.
    pub fn arm(&self, limit: u32) -> Result<()> {
        match &*self.inner {
            SrqInner::Embedded { h, id } => Ok(h.dev.lock().hca.arm_srq(*id, limit)?),
            SrqInner::Daemon(s) => {
                s.s.call(&softrdma_abi::msg::Request::ArmSrq { srq: s.id, limit }, &[])?;
                Ok(())
            }
        }
    }
}

/// A queue pair. Holds its CQs (and SRQ), so it cannot outlive them.
pub struct QueuePair {
    imp: QpImp,
    h: Dev,
    qpn: Qpn,
    qp_type: QpType,
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
    _srq: Option<Arc<SrqInner>>,
}

impl QueuePair {
    /// QP number.
    pub fn qpn(&self) -> Qpn {
        self.qpn
    }

    /// Transport type.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// Modify state and attributes; a path's source GID index must exist.
    pub fn modify(&self, attr: &ModifyQp) -> Result<()> {
        if let Some(av) = &attr.av {
            self.h.info().gid(1, usize::from(av.sgid_index))?;
        }
        match &self.imp {
            QpImp::Embedded { h, .. } => {
                h.dev.run(|st, now| h.dev.modify_qp(st, self.qpn, attr, now))?;
                Ok(())
            }
            QpImp::Daemon(q) => q.modify(attr),
        }
    }

    /// Current state and attributes.
    pub fn query(&self) -> Result<QueuePairInfo> {
        match &self.imp {
            QpImp::Embedded { h, .. } => Ok(h.dev.lock().hca.query_qp(self.qpn)?),
            QpImp::Daemon(q) => q.query(),
        }
    }

    /// Post a send work request. Embedded: its packets leave before this returns, unless the QP
    /// has packets unacknowledged over UDP: then they may wait for the progress that handles the
    /// ACK and leave batched with later ones (corked: see `Device::run_post`). Daemon: it is
    /// written to the send ring in shared memory (a doorbell system call only if the daemon's
    /// device loop sleeps).
    pub fn post_send(&self, wr: SendWr) -> Result<()> {
        match &self.imp {
            QpImp::Embedded { h, .. } => {
                h.dev.post_send(self.qpn, wr)?;
                Ok(())
            }
            QpImp::Daemon(q) => q.post_send(&wr),
        }
    }

    /// Post a list of send work requests under one lock (`ibv_post_send` with a chained list): the
    /// packets they produce leave in `sendmmsg` batches before this returns (or wait, corked, as
    /// for [`QueuePair::post_send`]). On the first refused
    /// request the error is returned; the requests before it stay posted (verbs' `bad_wr`).
    pub fn post_send_list(&self, wrs: impl IntoIterator<Item = SendWr>) -> Result<()> {
        match &self.imp {
            QpImp::Embedded { h, .. } => {
                h.dev.run_post(self.qpn, |st, now| {
                    let st = &mut *st;
                    (st.hca.post_send_list(self.qpn, wrs, now, &mut st.mem), false)
                })?;
                Ok(())
            }
            QpImp::Daemon(q) => q.post_send_list(wrs),
        }
    }

    /// Attach this UD QP to the multicast group `mgid` (`ibv_attach_mcast`): it receives what is
    /// sent to the group (destination QPN [`Qpn::MULTICAST`]), each attached QP a copy. The group's
    /// address is the MGID as an IP address (`::ffff:a.b.c.d` for IPv4 group a.b.c.d); the device
    /// joins it on its network interface. Attaching twice changes nothing. Refused for a QP that is
    /// not UD or a GID that is not multicast, and when the device has no address of the group's
    /// family. Destroying the QP detaches it.
    pub fn attach_mcast(&self, mgid: Gid) -> Result<()> {
        match &self.imp {
            QpImp::Embedded { h, .. } => h.dev.attach_mcast(self.qpn, mgid.0),
            QpImp::Daemon(q) => q.attach_mcast(mgid.0),
        }
    }

    /// Detach this QP from multicast group `mgid` (`ibv_detach_mcast`); refused if not attached.
    pub fn detach_mcast(&self, mgid: Gid) -> Result<()> {
        match &self.imp {
            QpImp::Embedded { h, .. } => h.dev.detach_mcast(self.qpn, mgid.0),
            QpImp::Daemon(q) => q.detach_mcast(mgid.0),
        }
    }

    /// Post a receive work request.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        match &self.imp {
            QpImp::Embedded { h, .. } => {
                // Posting a receive sends nothing: no flush.
                h.dev.run_quiet(|st, then| {
                    let st = &mut *st;
                    st.hca.post_recv(self.qpn, wr, then, &mut st.mem)
                })?;
                Ok(())
            }
            QpImp::Daemon(q) => q.post_recv(&wr),
        }
    }
}

enum QpImp {
    Embedded { h: Arc<DeviceHandle>, qpn: Qpn },
    Daemon(client::Qp),
}

impl Drop for QpImp {
    fn drop(&mut self) {
        if let QpImp::Embedded { h, qpn } = self {
            let mut st = h.dev.lock();
            // What it posted (a corked post) and the ACKs a poll left owed leave before it goes.
            h.dev.flush(&mut st, h.dev.now());
            let _ = st.destroy_qp(*qpn);
        }
    }
}

/// An address handle: where UD sends go.
#[derive(Debug, Clone, Copy)]
pub struct AddressHandle {
    av: AddressVector,
}

impl AddressHandle {
    /// A UD destination through this handle.
    pub fn ud(&self, remote_qpn: Qpn, remote_qkey: u32) -> UdDest {
        UdDest { av: self.av, remote_qpn, remote_qkey }
    }

    /// The address vector (also the `av` of an RC/UC modify to RTR).
    pub fn av(&self) -> AddressVector {
        self.av
    }
}

impl ProtectionDomain {
    /// An address vector for connecting RC/UC QPs (the `ah_attr` of `ibv_modify_qp`).
    pub fn path(&self, attr: &AhAttr) -> Result<AddressVector> {
        av_from(&self.h, attr)
    }

    /// The PD's engine id.
    pub fn id(&self) -> PdId {
        self.id
    }
}

/// What it takes to connect an RC or UC queue pair to a remote one (the out-of-band exchange of
/// rdma-core's pingpong examples carries the remote QPN, PSN and GID).
#[derive(Debug, Clone, Copy)]
pub struct ConnectParams {
    /// Remote QP number.
    pub remote_qpn: Qpn,
    /// The remote side's first send PSN (our receive PSN).
    pub remote_psn: Psn,
    /// Remote GID.
    pub remote_gid: Gid,
    /// Our first send PSN.
    pub local_psn: Psn,
    /// Local GID index to send from.
    pub sgid_index: u8,
    /// Path MTU.
    pub mtu: Mtu,
    /// Remote access rights granted.
    pub access: Access,
    /// Initiator depth and responder resources.
    pub rd_atomic: u8,
    /// Local ACK timeout exponent.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7: forever).
    pub rnr_retry: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
}

impl ConnectParams {
    /// Defaults as rc_pingpong uses them: MTU 1024, GID index 1, timeout 14, 7 retries, RNR timer 12,
    /// all remote rights, 16 reads/atomics in flight.
    pub fn new(remote_qpn: Qpn, remote_psn: Psn, remote_gid: Gid, local_psn: Psn) -> ConnectParams {
        ConnectParams {
            remote_qpn,
            remote_psn,
            remote_gid,
            local_psn,
            sgid_index: 1,
            mtu: Mtu::M1024,
            access: Access::LOCAL_WRITE
                .with(Access::REMOTE_WRITE)
                .with(Access::REMOTE_READ)
                .with(Access::REMOTE_ATOMIC),
            rd_atomic: 16,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
        }
    }
}

impl QueuePair {
    /// Take an RC or UC QP from RESET to INIT, granting `access` (receives may be posted then).
    pub fn init(&self, access: Access) -> Result<()> {
        self.modify(&ModifyQp {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(access),
            ..Default::default()
        })
    }

    /// Take an RC or UC QP from RESET (or INIT) through RTR to RTS towards a remote QP.
    pub fn connect(&self, pd: &ProtectionDomain, p: &ConnectParams) -> Result<()> {
        let rc = self.qp_type == QpType::Rc;
        if self.qp_type == QpType::Ud {
            return Err(Error::InvalidArgument("UD QPs are not connected: use bring_up_ud".into()));
        }
        match self.query()?.state {
            QpState::Reset => self.init(p.access)?,
            QpState::Init => self.modify(&ModifyQp { access: Some(p.access), ..Default::default() })?,
            s => return Err(Error::InvalidArgument(format!("connect needs a QP in RESET or INIT, not {}", s.name()))),
        }
        self.modify(&ModifyQp {
            state: Some(QpState::Rtr),
            av: Some(pd.path(&AhAttr::new(p.remote_gid, p.sgid_index))?),
            path_mtu: Some(p.mtu),
            dest_qpn: Some(p.remote_qpn),
            rq_psn: Some(p.remote_psn),
            max_dest_rd_atomic: rc.then_some(p.rd_atomic),
            min_rnr_timer: rc.then_some(p.min_rnr_timer),
            ..Default::default()
        })?;
        self.modify(&ModifyQp {
            state: Some(QpState::Rts),
            sq_psn: Some(p.local_psn),
            timeout: rc.then_some(p.timeout),
            retry_cnt: rc.then_some(p.retry_cnt),
            rnr_retry: rc.then_some(p.rnr_retry),
            max_rd_atomic: rc.then_some(p.rd_atomic),
            ..Default::default()
        })
    }

    /// Take a UD QP from RESET to RTS with Q_Key `qkey`.
    pub fn bring_up_ud(&self, qkey: u32, psn: Psn) -> Result<()> {
        self.modify(&ModifyQp {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            qkey: Some(qkey),
            ..Default::default()
        })?;
        self.modify(&ModifyQp { state: Some(QpState::Rtr), ..Default::default() })?;
        self.modify(&ModifyQp { state: Some(QpState::Rts), sq_psn: Some(psn), ..Default::default() })
    }
}
