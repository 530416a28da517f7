/*
 * The C side of softrdma's librdmacm ABI: compiled against rdma-core's <rdma/rdma_cma.h> and
 * <rdma/rdma_verbs.h> (Debian librdmacm-dev), linked to our librdmacm.so.1 and libibverbs.so.1
 * (tests/rdmacm.rs builds and runs it). One process, two devices (abi0 on 127.0.0.9 serving,
 * abi1 on 127.0.0.10 connecting):
 *
 * 1. struct sizes and offsets: the numbers crates/ffi/src/cma_abi.rs pins, against the header;
 * 2. rdma_getaddrinfo, rdma_event_str, bind errors (EADDRNOTAVAIL, EADDRINUSE), a non-blocking
 *    channel (EAGAIN), the channel fd polling readable;
 * 3. an RC connection with private data both ways: CONNECT_REQUEST (id, listen_id, qp_num),
 *    rdma_create_qp with the ID's default PD and CQs, data through rdma_verbs.h's inline
 *    helpers, disconnect with DISCONNECTED on both sides and the QPs in ERR;
 * 4. a synchronous ID (NULL channel) connecting where nobody listens: -1 and ECONNREFUSED;
 * 5. a thread blocked in rdma_get_cm_event while the channel is destroyed stays blocked.
 *
 * Prints one line per failed check and "abi_rdmacm: N checks, M failed"; exits 1 on failure.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

static int checks, failed;

#define CHECK(cond, ...)                                                       \
	do {                                                                   \
		checks++;                                                      \
		if (!(cond)) {                                                 \
			failed++;                                              \
			printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
			printf(__VA_ARGS__);                                   \
			printf(" (errno %d)\n", errno);                        \
		}                                                              \
	} while (0)

#define SIZE(t, n) CHECK(sizeof(struct t) == (n), "sizeof(struct " #t ") = %zu", sizeof(struct t))
#define OFF(t, f, n) \
	CHECK(offsetof(struct t, f) == (n), "offsetof(" #t ", " #f ") = %zu", offsetof(struct t, f))

static void layouts(void)
{
	SIZE(rdma_ib_addr, 40);
	SIZE(rdma_addr, 296);
	SIZE(ibv_sa_path_rec, 64);
	OFF(ibv_sa_path_rec, pkey, 54);
	SIZE(rdma_route, 312);
	OFF(rdma_cm_id, route, 32);
	OFF(rdma_cm_id, ps, 344);
	OFF(rdma_cm_id, port_num, 348);
	OFF(rdma_cm_id, event, 352);
	OFF(rdma_cm_id, pd, 400);
	OFF(rdma_cm_id, qp_type, 408);
	SIZE(rdma_cm_id, 416);
	SIZE(rdma_conn_param, 24);
	OFF(rdma_conn_param, qp_num, 16);
	SIZE(rdma_ud_param, 56);
	OFF(rdma_ud_param, ah_attr, 16);
	OFF(rdma_ud_param, qp_num, 48);
	SIZE(rdma_cm_event, 80);
	OFF(rdma_cm_event, param, 24);
	SIZE(rdma_addrinfo, 96);
	OFF(rdma_addrinfo, ai_src_addr, 24);
	OFF(rdma_addrinfo, ai_next, 88);
	SIZE(rdma_cm_join_mc_attr_ex, 16);
	OFF(rdma_cm_join_mc_attr_ex, addr, 8);
}

static struct sockaddr_in sin_of(const char *ip, int port)
{
	struct sockaddr_in s;
	memset(&s, 0, sizeof s);
	s.sin_family = AF_INET;
	s.sin_port = htons(port);
	inet_pton(AF_INET, ip, &s.sin_addr);
	return s;
}

/* The next event of `ch`, which must be `type`; NULL (and a failed check) otherwise. */
static struct rdma_cm_event *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type type)
{
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	struct rdma_cm_event *e = NULL;

	CHECK(poll(&p, 1, 10000) == 1, "no event, expected %s", rdma_event_str(type));
	if (rdma_get_cm_event(ch, &e)) {
		CHECK(0, "rdma_get_cm_event failed, expected %s", rdma_event_str(type));
		return NULL;
	}
	CHECK(e->event == type, "got %s (status %d), expected %s", rdma_event_str(e->event),
	      e->status, rdma_event_str(type));
	return e->event == type ? e : (rdma_ack_cm_event(e), NULL);
}

static void basics(void)
{
	struct rdma_addrinfo hints, *res = NULL;
	struct rdma_event_channel *ch;
	struct rdma_cm_event *e;
	struct rdma_cm_id *a, *b;
	struct sockaddr_in s;
	int fl;

	CHECK(!strcmp(rdma_event_str(RDMA_CM_EVENT_ESTABLISHED), "RDMA_CM_EVENT_ESTABLISHED"), "str");
	CHECK(!strcmp(rdma_event_str(99), "UNKNOWN EVENT"), "unknown");

	memset(&hints, 0, sizeof hints);
	hints.ai_flags = RAI_PASSIVE;
	hints.ai_port_space = RDMA_PS_TCP;
	CHECK(rdma_getaddrinfo("127.0.0.9", "7000", &hints, &res) == 0, "getaddrinfo");
	if (res) {
		struct sockaddr_in *src = (struct sockaddr_in *)res->ai_src_addr;
		CHECK(res->ai_flags & RAI_PASSIVE, "passive");
		CHECK(res->ai_qp_type == IBV_QPT_RC && res->ai_port_space == RDMA_PS_TCP, "RC/TCP");
		CHECK(src && res->ai_src_len == sizeof *src && ntohs(src->sin_port) == 7000 &&
		      src->sin_addr.s_addr == inet_addr("127.0.0.9"), "source address");
		CHECK(res->ai_dst_addr == NULL, "no destination");
		rdma_freeaddrinfo(res);
	}

	ch = rdma_create_event_channel();
	CHECK(ch && ch->fd >= 0, "channel");
	if (!ch)
		return;
	fl = fcntl(ch->fd, F_GETFL);
	fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK);
	errno = 0;
	CHECK(rdma_get_cm_event(ch, &e) == -1 && errno == EAGAIN, "non-blocking get");
	fcntl(ch->fd, F_SETFL, fl);

	CHECK(rdma_create_id(ch, &a, NULL, RDMA_PS_TCP) == 0, "create a");
	CHECK(rdma_create_id(ch, &b, NULL, RDMA_PS_TCP) == 0, "create b");
	CHECK(a->verbs == NULL && a->qp_type == IBV_QPT_RC && a->ps == RDMA_PS_TCP, "fresh id");
	s = sin_of("127.0.0.77", 7000);
	errno = 0;
	CHECK(rdma_bind_addr(a, (struct sockaddr *)&s) == -1 && errno == EADDRNOTAVAIL,
	      "bind to an address no device has");
	s = sin_of("127.0.0.9", 7000);
	CHECK(rdma_bind_addr(a, (struct sockaddr *)&s) == 0, "bind");
	CHECK(a->verbs && a->pd && a->port_num == 1, "bound id has a device and a PD");
	CHECK(rdma_get_src_port(a) == htons(7000), "src port %d", ntohs(rdma_get_src_port(a)));
	CHECK(((struct sockaddr_in *)rdma_get_local_addr(a))->sin_addr.s_addr ==
	      inet_addr("127.0.0.9"), "local addr");
	errno = 0;
	CHECK(rdma_bind_addr(b, (struct sockaddr *)&s) == -1 && errno == EADDRINUSE, "port taken");
	CHECK(rdma_destroy_id(a) == 0 && rdma_destroy_id(b) == 0, "destroy");
	rdma_destroy_event_channel(ch);
}

static void connection(void)
{
	struct rdma_event_channel *sch = rdma_create_event_channel();
	struct rdma_event_channel *cch = rdma_create_event_channel();
	struct rdma_cm_id *listener, *client, *server = NULL;
	struct ibv_qp_init_attr attr;
	struct rdma_conn_param param;
	struct rdma_cm_event *e;
	struct sockaddr_in s = sin_of("127.0.0.9", 7001);
	char cbuf[64] = "ping over rdma_cm", sbuf[64];
	struct ibv_mr *cmr = NULL, *smr = NULL;
	struct ibv_wc wc;
	int ret;

	CHECK(rdma_create_id(sch, &listener, (void *)0x1234, RDMA_PS_TCP) == 0, "listener");
	CHECK(rdma_bind_addr(listener, (struct sockaddr *)&s) == 0, "bind");
	CHECK(rdma_listen(listener, 4) == 0, "listen");
	CHECK(rdma_create_id(cch, &client, NULL, RDMA_PS_TCP) == 0, "client");
	/* No source: the device that does not own the destination (abi1). */
	CHECK(rdma_resolve_addr(client, NULL, (struct sockaddr *)&s, 2000) == 0, "resolve addr");
	if ((e = expect(cch, RDMA_CM_EVENT_ADDR_RESOLVED))) {
		CHECK(e->id == client && e->status == 0, "addr event");
		rdma_ack_cm_event(e);
	}
	CHECK(((struct sockaddr_in *)rdma_get_local_addr(client))->sin_addr.s_addr ==
	      inet_addr("127.0.0.10"), "client on abi1");
	CHECK(rdma_get_dst_port(client) == htons(7001), "dst port");
	CHECK(rdma_resolve_route(client, 2000) == 0, "resolve route");
	if ((e = expect(cch, RDMA_CM_EVENT_ROUTE_RESOLVED))) {
		CHECK(client->route.num_paths == 1 && client->route.path_rec, "path record");
		rdma_ack_cm_event(e);
	}
	memset(&attr, 0, sizeof attr);
	attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	attr.qp_type = IBV_QPT_RC;
	attr.sq_sig_all = 1;
	CHECK(rdma_create_qp(client, NULL, &attr) == 0, "client QP");
	CHECK(client->qp && client->qp->state == IBV_QPS_INIT && client->qp->pd == client->pd,
	      "client QP in INIT on the ID's PD");
	CHECK(client->send_cq && client->recv_cq && client->send_cq_channel, "ID's CQs");
	cmr = rdma_reg_msgs(client, cbuf, sizeof cbuf);
	CHECK(cmr != NULL, "client MR");
	memset(&param, 0, sizeof param);
	param.private_data = "hello";
	param.private_data_len = 6;
	param.responder_resources = param.initiator_depth = 1;
	param.retry_count = param.rnr_retry_count = 7;
	CHECK(rdma_connect(client, &param) == 0, "connect");

	if ((e = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST))) {
		server = e->id;
		CHECK(e->listen_id == listener && server != listener, "request ids");
		CHECK(server->context == (void *)0x1234 && server->verbs == listener->verbs,
		      "new id inherits context and device");
		CHECK(e->param.conn.private_data_len >= 6 &&
		      !memcmp(e->param.conn.private_data, "hello", 6), "request private data");
		CHECK(e->param.conn.qp_num == client->qp->qp_num, "request qp_num");
		CHECK(((struct sockaddr_in *)rdma_get_peer_addr(server))->sin_addr.s_addr ==
		      inet_addr("127.0.0.10"), "peer addr");
		rdma_ack_cm_event(e);
	}
	if (!server)
		goto out;
	memset(&attr, 0, sizeof attr);
	attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	attr.qp_type = IBV_QPT_RC;
	attr.sq_sig_all = 1;
	CHECK(rdma_create_qp(server, NULL, &attr) == 0, "server QP");
	smr = rdma_reg_msgs(server, sbuf, sizeof sbuf);
	CHECK(smr && rdma_post_recv(server, server, sbuf, sizeof sbuf, smr) == 0, "server recv");
	memset(&param, 0, sizeof param);
	param.private_data = "welcome";
	param.private_data_len = 8;
	CHECK(rdma_accept(server, &param) == 0, "accept");
	if ((e = expect(cch, RDMA_CM_EVENT_ESTABLISHED))) {
		CHECK(e->param.conn.private_data_len >= 8 &&
		      !memcmp(e->param.conn.private_data, "welcome", 8), "reply private data");
		CHECK(e->param.conn.qp_num == server->qp->qp_num, "reply qp_num");
		rdma_ack_cm_event(e);
	}
	if ((e = expect(sch, RDMA_CM_EVENT_ESTABLISHED)))
		rdma_ack_cm_event(e);
	CHECK(client->qp->state == IBV_QPS_RTS, "client QP state %d", client->qp->state);

	CHECK(rdma_post_send(client, client, cbuf, sizeof cbuf, cmr, 0) == 0, "send");
	while ((ret = rdma_get_send_comp(client, &wc)) == 0)
		;
	CHECK(ret > 0 && wc.status == IBV_WC_SUCCESS, "send completion %d", wc.status);
	while ((ret = rdma_get_recv_comp(server, &wc)) == 0)
		;
	CHECK(ret > 0 && wc.status == IBV_WC_SUCCESS && wc.byte_len == sizeof cbuf &&
	      wc.wr_id == (uintptr_t)server && !strcmp(sbuf, "ping over rdma_cm"), "received");

	CHECK(rdma_disconnect(client) == 0, "disconnect");
	if ((e = expect(cch, RDMA_CM_EVENT_DISCONNECTED)))
		rdma_ack_cm_event(e);
	if ((e = expect(sch, RDMA_CM_EVENT_DISCONNECTED)))
		rdma_ack_cm_event(e);
	CHECK(client->qp->state == IBV_QPS_ERR && server->qp->state == IBV_QPS_ERR, "QPs in ERR");
	CHECK(rdma_disconnect(server) == 0, "disconnecting a closed connection succeeds");

	rdma_dereg_mr(smr);
	rdma_destroy_qp(server);
	CHECK(rdma_destroy_id(server) == 0, "destroy server");
out:
	if (cmr)
		rdma_dereg_mr(cmr);
	rdma_destroy_qp(client);
	CHECK(rdma_destroy_id(client) == 0, "destroy client");
	CHECK(rdma_destroy_id(listener) == 0, "destroy listener");
	rdma_destroy_event_channel(sch);
	rdma_destroy_event_channel(cch);
}

static void synchronous_reject(void)
{
	struct rdma_cm_id *id;
	struct sockaddr_in src = sin_of("127.0.0.10", 0), dst = sin_of("127.0.0.9", 7999);
	struct rdma_conn_param param;

	CHECK(rdma_create_id(NULL, &id, NULL, RDMA_PS_TCP) == 0, "sync id");
	CHECK(rdma_resolve_addr(id, (struct sockaddr *)&src, (struct sockaddr *)&dst, 2000) == 0,
	      "sync resolve addr");
	CHECK(id->event && id->event->event == RDMA_CM_EVENT_ADDR_RESOLVED, "kept event");
	CHECK(rdma_resolve_route(id, 2000) == 0, "sync resolve route");
	memset(&param, 0, sizeof param);
	errno = 0;
	CHECK(rdma_connect(id, &param) == -1 && errno == ECONNREFUSED, "nobody listens");
	CHECK(id->event && id->event->event == RDMA_CM_EVENT_REJECTED && id->event->status == 8,
	      "REJECTED, invalid service ID");
	CHECK(rdma_destroy_id(id) == 0, "destroy sync id");
}

static volatile int waiter_returned;

static void *waiter(void *channel)
{
	struct rdma_cm_event *ev;

	rdma_get_cm_event(channel, &ev);
	waiter_returned = 1;
	return NULL;
}

/*
 * rping's event thread waits in rdma_get_cm_event while its main thread destroys the IDs and then
 * the channel; a late event for a destroyed ID still wakes the waiter. In librdmacm it stays
 * blocked in the kernel on the channel's file; ours must too (not return EBADF, which rping
 * reports and exits 1 on, nor touch the freed channel). The wake is injected with an eventfd in
 * the channel's fd, which is an epoll set in this implementation.
 */
static void destroy_under_waiter(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct epoll_event e = { .events = EPOLLIN };
	int efd = eventfd(0, EFD_NONBLOCK);
	uint64_t one = 1;
	pthread_t t;

	CHECK(ch && efd >= 0, "channel and eventfd");
	if (!ch || efd < 0)
		return;
	CHECK(epoll_ctl(ch->fd, EPOLL_CTL_ADD, efd, &e) == 0, "eventfd in the channel's epoll set");
	CHECK(pthread_create(&t, NULL, waiter, ch) == 0, "waiter thread");
	usleep(50000);
	rdma_destroy_event_channel(ch);
	CHECK(write(efd, &one, sizeof one) == sizeof one, "wake the waiter");
	usleep(100000);
	CHECK(!waiter_returned, "the waiter returned from a destroyed channel");
	pthread_detach(t);
}

/*
 * rdma_join_multicast on a UD ID, as librdmacm on RoCE: MULTICAST_JOIN with the group's MGID
 * (::ffff:a.b.c.d), QPN 0xffffff, RDMA_UDP_QKEY and the caller's context as private_data; and
 * the errors for an ID with no address, a TCP ID, a unicast address, a second join, a leave of
 * what was not joined.
 */
static void multicast(void)
{
	static const uint8_t mgid[16] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 1, 2, 3 };
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct sockaddr_in su = sin_of("127.0.0.9", 7010), st = sin_of("127.0.0.9", 7011);
	struct sockaddr_in g = sin_of("239.1.2.3", 0), u = sin_of("127.0.0.9", 0);
	struct rdma_cm_id *ud = NULL, *tcp = NULL;
	struct rdma_cm_event *e;

	CHECK(ch != NULL, "channel");
	if (!ch)
		return;
	CHECK(rdma_create_id(ch, &ud, NULL, RDMA_PS_UDP) == 0 && rdma_create_id(ch, &tcp, NULL, RDMA_PS_TCP) == 0,
	      "ids");
	errno = 0;
	CHECK(rdma_join_multicast(ud, (struct sockaddr *)&g, NULL) == -1 && errno == EINVAL, "join with no address");
	CHECK(rdma_bind_addr(ud, (struct sockaddr *)&su) == 0 && rdma_bind_addr(tcp, (struct sockaddr *)&st) == 0,
	      "bind");
	errno = 0;
	CHECK(rdma_join_multicast(tcp, (struct sockaddr *)&g, NULL) == -1 && errno == EINVAL, "join on a TCP id");
	errno = 0;
	CHECK(rdma_join_multicast(ud, (struct sockaddr *)&u, NULL) == -1 && errno == EINVAL, "join a unicast address");
	errno = 0;
	CHECK(rdma_leave_multicast(ud, (struct sockaddr *)&g) == -1 && errno == EADDRNOTAVAIL, "leave before join");
	CHECK(rdma_join_multicast(ud, (struct sockaddr *)&g, (void *)0x5678) == 0, "join");
	e = expect(ch, RDMA_CM_EVENT_MULTICAST_JOIN);
	if (e) {
		CHECK(e->id == ud && e->status == 0, "join event");
		CHECK(e->param.ud.private_data == (void *)0x5678, "the context as private data");
		CHECK(e->param.ud.qp_num == 0xffffff && e->param.ud.qkey == RDMA_UDP_QKEY, "QPN %x, Q_Key %x",
		      e->param.ud.qp_num, e->param.ud.qkey);
		CHECK(e->param.ud.ah_attr.is_global && !memcmp(e->param.ud.ah_attr.grh.dgid.raw, mgid, 16),
		      "the group's MGID");
		rdma_ack_cm_event(e);
	}
	/* A second join is allowed; each is left once. */
	CHECK(rdma_join_multicast(ud, (struct sockaddr *)&g, NULL) == 0, "join twice");
	e = expect(ch, RDMA_CM_EVENT_MULTICAST_JOIN);
	if (e)
		rdma_ack_cm_event(e);
	CHECK(rdma_leave_multicast(ud, (struct sockaddr *)&g) == 0 && rdma_leave_multicast(ud, (struct sockaddr *)&g) == 0,
	      "leave both");
	errno = 0;
	CHECK(rdma_leave_multicast(ud, (struct sockaddr *)&g) == -1 && errno == EADDRNOTAVAIL, "leave a third time");

	/* A join left before it was reported is never reported. */
	CHECK(rdma_join_multicast(ud, (struct sockaddr *)&g, NULL) == 0 && rdma_leave_multicast(ud, (struct sockaddr *)&g) == 0,
	      "join and leave");
	{
		int fl = fcntl(ch->fd, F_GETFL);
		struct rdma_cm_event *none = NULL;

		fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK);
		errno = 0;
		CHECK(rdma_get_cm_event(ch, &none) == -1 && errno == EAGAIN, "no event for a join left");
		fcntl(ch->fd, F_SETFL, fl);
	}

	/* With a QP: attached when the join is reported (ibv_destroy_qp refuses while attached), not
	 * for a send-only member, detached by the leave. */
	{
		struct ibv_qp_init_attr qa = { .cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
					       .qp_type = IBV_QPT_UD };
		struct rdma_cm_join_mc_attr_ex x = { .comp_mask = RDMA_CM_JOIN_MC_ATTR_ADDRESS | RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS,
						     .join_flags = RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER,
						     .addr = (struct sockaddr *)&g };

		union ibv_gid mg;

		memcpy(mg.raw, mgid, 16);
		CHECK(rdma_create_qp(ud, NULL, &qa) == 0, "UD QP on the ID: %s", strerror(errno));
		CHECK(rdma_join_multicast_ex(ud, &x, NULL) == 0, "send-only join");
		e = expect(ch, RDMA_CM_EVENT_MULTICAST_JOIN);
		if (e)
			rdma_ack_cm_event(e);
		CHECK(ud->qp && ibv_detach_mcast(ud->qp, &mg, 0) == EINVAL, "a send-only member's QP is not attached");
		CHECK(rdma_leave_multicast(ud, (struct sockaddr *)&g) == 0, "leave the send-only join");
		CHECK(rdma_join_multicast(ud, (struct sockaddr *)&g, NULL) == 0, "full join");
		e = expect(ch, RDMA_CM_EVENT_MULTICAST_JOIN);
		if (e)
			rdma_ack_cm_event(e);
		CHECK(ud->qp && ibv_destroy_qp(ud->qp) == EBUSY, "the QP is attached once the join is reported");
		CHECK(rdma_leave_multicast(ud, (struct sockaddr *)&g) == 0, "leave");
		CHECK(ud->qp && ibv_detach_mcast(ud->qp, &mg, 0) == EINVAL, "the leave detached the QP");
		rdma_destroy_qp(ud);
	}
	CHECK(rdma_destroy_id(ud) == 0 && rdma_destroy_id(tcp) == 0, "destroy");
	rdma_destroy_event_channel(ch);
}

int main(void)
{
	layouts();
	basics();
	connection();
	synchronous_reject();
	multicast();
	destroy_under_waiter();
	printf("abi_rdmacm: %d checks, %d failed\n", checks, failed);
	return failed ? 1 : 0;
}
