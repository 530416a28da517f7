/*
 * librdmacm.so.1 for softrdma: rdma-core 44's librdmacm symbols (RDMACM_1.0 ... RDMACM_1.3) for
 * unmodified programs. The connection manager itself lives in softrdma's libibverbs.so.1, next to
 * the verbs objects an rdma_cm_id hands out (src/cma.rs explains why); every rdma_* function here
 * forwards to its softrdma_rdma_* twin there, exported under SOFTRDMA_PRIVATE_1.
 *
 * rsockets (rsocket, rsend, ...) are not provided: rsocket() fails with ENOSYS, so no descriptor
 * is ever an rsocket, and the calls that take one fail with EBADF; rpoll and rselect are poll and
 * select, which is what they are for ordinary descriptors (rdma-core's examples call rpoll).
 *
 * Built twice by build.rs: as the library, and with SOFTRDMA_LINK_STUB as a stand-in
 * libibverbs.so.1 defining the softrdma_rdma_* symbols, to link the library against (the real
 * libibverbs.so.1 is not built yet when build.rs runs).
 */
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#ifdef SOFTRDMA_LINK_STUB
#define FWD(ret, name, params, args) \
	ret softrdma_##name params; \
	ret softrdma_##name params { return (ret)0; }
#define FWDV(name, params, args) \
	void softrdma_##name params; \
	void softrdma_##name params { }
#else
#define FWD(ret, name, params, args) \
	ret softrdma_##name params; \
	ret name params; \
	ret name params { return softrdma_##name args; }
#define FWDV(name, params, args) \
	void softrdma_##name params; \
	void name params; \
	void name params { softrdma_##name args; }
#endif

/* The structs are opaque here: every parameter is a pointer or an integer. */
typedef void *P;
typedef const void *CP;

/* RDMACM_1.0 */
FWD(P, rdma_create_event_channel, (void), ())
FWDV(rdma_destroy_event_channel, (P channel), (channel))
FWD(int, rdma_create_id, (P channel, P id, P context, int ps), (channel, id, context, ps))
FWD(int, rdma_create_ep, (P id, P res, P pd, P qp_init_attr), (id, res, pd, qp_init_attr))
FWDV(rdma_destroy_ep, (P id), (id))
FWD(int, rdma_destroy_id, (P id), (id))
FWD(int, rdma_bind_addr, (P id, P addr), (id, addr))
FWD(int, rdma_resolve_addr, (P id, P src, P dst, int timeout_ms), (id, src, dst, timeout_ms))
FWD(int, rdma_resolve_route, (P id, int timeout_ms), (id, timeout_ms))
FWD(int, rdma_create_qp, (P id, P pd, P attr), (id, pd, attr))
FWD(int, rdma_create_qp_ex, (P id, P attr), (id, attr))
FWDV(rdma_destroy_qp, (P id), (id))
FWD(int, rdma_connect, (P id, P param), (id, param))
FWD(int, rdma_listen, (P id, int backlog), (id, backlog))
FWD(int, rdma_get_request, (P listen, P id), (listen, id))
FWD(int, rdma_accept, (P id, P param), (id, param))
FWD(int, rdma_reject, (P id, CP data, uint8_t len), (id, data, len))
FWD(int, rdma_notify, (P id, int event), (id, event))
FWD(int, rdma_disconnect, (P id), (id))
FWD(int, rdma_join_multicast, (P id, P addr, P context), (id, addr, context))
FWD(int, rdma_leave_multicast, (P id, P addr), (id, addr))
FWD(int, rdma_get_cm_event, (P channel, P event), (channel, event))
FWD(int, rdma_ack_cm_event, (P event), (event))
FWD(uint16_t, rdma_get_src_port, (P id), (id))
FWD(uint16_t, rdma_get_dst_port, (P id), (id))
FWD(P, rdma_get_devices, (int *num), (num))
FWDV(rdma_free_devices, (P list), (list))
FWD(const char *, rdma_event_str, (int event), (event))
FWD(int, rdma_set_option, (P id, int level, int name, P val, size_t len), (id, level, name, val, len))
FWD(int, rdma_migrate_id, (P id, P channel), (id, channel))
FWD(int, rdma_getaddrinfo, (const char *node, const char *service, CP hints, P res),
    (node, service, hints, res))
FWDV(rdma_freeaddrinfo, (P res), (res))
FWD(int, rdma_create_srq, (P id, P pd, P attr), (id, pd, attr))
FWD(int, rdma_create_srq_ex, (P id, P attr), (id, attr))
FWDV(rdma_destroy_srq, (P id), (id))
/* RDMACM_1.1 */
FWD(int, rdma_join_multicast_ex, (P id, P attr, P context), (id, attr, context))
/* RDMACM_1.2 */
FWD(int, rdma_establish, (P id), (id))
FWD(int, rdma_init_qp_attr, (P id, P attr, int *mask), (id, attr, mask))
/* RDMACM_1.3 */
FWD(int, rdma_set_local_ece, (P id, P ece), (id, ece))
FWD(int, rdma_get_remote_ece, (P id, P ece), (id, ece))
FWD(int, rdma_reject_ece, (P id, CP data, uint8_t len), (id, data, len))

#ifndef SOFTRDMA_LINK_STUB
/* rsockets: see the top of the file. */
#define NOSOCK(ret, name, params, use) \
	ret name params; \
	ret name params { use; errno = EBADF; return (ret)-1; }

int rsocket(int domain, int type, int protocol);
int rsocket(int domain, int type, int protocol)
{ (void)domain; (void)type; (void)protocol; errno = ENOSYS; return -1; }

int rpoll(struct pollfd *fds, nfds_t nfds, int timeout);
int rpoll(struct pollfd *fds, nfds_t nfds, int timeout) { return poll(fds, nfds, timeout); }

int rselect(int nfds, fd_set *r, fd_set *w, fd_set *e, struct timeval *t);
int rselect(int nfds, fd_set *r, fd_set *w, fd_set *e, struct timeval *t)
{ return select(nfds, r, w, e, t); }

int rfcntl(int s, int cmd, ...);
int rfcntl(int s, int cmd, ...) { (void)s; (void)cmd; errno = EBADF; return -1; }

NOSOCK(int, rbind, (int s, const struct sockaddr *a, socklen_t l), ((void)s, (void)a, (void)l))
NOSOCK(int, rlisten, (int s, int backlog), ((void)s, (void)backlog))
NOSOCK(int, raccept, (int s, struct sockaddr *a, socklen_t *l), ((void)s, (void)a, (void)l))
NOSOCK(int, rconnect, (int s, const struct sockaddr *a, socklen_t l), ((void)s, (void)a, (void)l))
NOSOCK(int, rshutdown, (int s, int how), ((void)s, (void)how))
NOSOCK(int, rclose, (int s), ((void)s))
NOSOCK(ssize_t, rrecv, (int s, void *b, size_t n, int f), ((void)s, (void)b, (void)n, (void)f))
NOSOCK(ssize_t, rrecvfrom, (int s, void *b, size_t n, int f, struct sockaddr *a, socklen_t *l),
       ((void)s, (void)b, (void)n, (void)f, (void)a, (void)l))
NOSOCK(ssize_t, rrecvmsg, (int s, struct msghdr *m, int f), ((void)s, (void)m, (void)f))
NOSOCK(ssize_t, rsend, (int s, const void *b, size_t n, int f), ((void)s, (void)b, (void)n, (void)f))
NOSOCK(ssize_t, rsendto, (int s, const void *b, size_t n, int f, const struct sockaddr *a, socklen_t l),
       ((void)s, (void)b, (void)n, (void)f, (void)a, (void)l))
NOSOCK(ssize_t, rsendmsg, (int s, const struct msghdr *m, int f), ((void)s, (void)m, (void)f))
NOSOCK(ssize_t, rread, (int s, void *b, size_t n), ((void)s, (void)b, (void)n))
NOSOCK(ssize_t, rreadv, (int s, const struct iovec *v, int n), ((void)s, (void)v, (void)n))
NOSOCK(ssize_t, rwrite, (int s, const void *b, size_t n), ((void)s, (void)b, (void)n))
NOSOCK(ssize_t, rwritev, (int s, const struct iovec *v, int n), ((void)s, (void)v, (void)n))
NOSOCK(int, rgetpeername, (int s, struct sockaddr *a, socklen_t *l), ((void)s, (void)a, (void)l))
NOSOCK(int, rgetsockname, (int s, struct sockaddr *a, socklen_t *l), ((void)s, (void)a, (void)l))
NOSOCK(int, rsetsockopt, (int s, int lv, int o, const void *v, socklen_t l),
       ((void)s, (void)lv, (void)o, (void)v, (void)l))
NOSOCK(int, rgetsockopt, (int s, int lv, int o, void *v, socklen_t *l),
       ((void)s, (void)lv, (void)o, (void)v, (void)l))
NOSOCK(off_t, riomap, (int s, void *b, size_t n, int p, int f, off_t o),
       ((void)s, (void)b, (void)n, (void)p, (void)f, (void)o))
NOSOCK(int, riounmap, (int s, void *b, size_t n), ((void)s, (void)b, (void)n))
NOSOCK(size_t, riowrite, (int s, const void *b, size_t n, off_t o, int f),
       ((void)s, (void)b, (void)n, (void)o, (void)f))
#endif
