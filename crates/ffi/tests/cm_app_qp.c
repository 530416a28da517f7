/*
 * librdmacm as the kernel runs it for an application that owns its QPs, plus address errors and
 * IPv6: compiled against rdma-core's headers, linked to our librdmacm.so.1 and libibverbs.so.1
 * (tests/rdmacm.rs builds and runs it). One process, three devices: app0 (127.0.0.11) serving,
 * app1 (127.0.0.12) connecting, app6 (::1) for IPv6.
 *
 * 1. QPs made with ibv_create_qp, none on the IDs: rdma_init_qp_attr gives INIT (no remote access
 *    before a connection), RTR and RTS with the kernel's masks and values; the passive side moves
 *    its QP to RTS before rdma_accept; the active side gets CONNECT_RESPONSE, moves its QP and
 *    calls rdma_establish, the passive side gets ESTABLISHED, the active side nothing more;
 *    SEND and RDMA WRITE byte-checked; after the disconnect the QPs are where the application put
 *    them (RTS);
 * 2. ADDR_ERROR with the route lookup's status (-EINVAL from a loopback source to 198.51.100.7,
 *    nothing sent), and errno EINVAL on a synchronous ID;
 * 3. an RC connection over ::1 on one device: AF_INET6 addresses in the IDs and events, the path
 *    record's GIDs, data, disconnect.
 *
 * Prints one line per failed check and "cm_app_qp: N checks, M failed"; exits 1 on failure.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

static struct sockaddr_in sin_of(const char *ip, int port)
{
	struct sockaddr_in s;
	memset(&s, 0, sizeof s);
	s.sin_family = AF_INET;
	s.sin_port = htons(port);
	inet_pton(AF_INET, ip, &s.sin_addr);
	return s;
}

static struct sockaddr_in6 sin6_of(const char *ip, int port)
{
	struct sockaddr_in6 s;
	memset(&s, 0, sizeof s);
	s.sin6_family = AF_INET6;
	s.sin6_port = htons(port);
	inet_pton(AF_INET6, ip, &s.sin6_addr);
	return s;
}

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

static int quiet(struct rdma_event_channel *ch, int ms)
{
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	return poll(&p, 1, ms) == 0;
}

/* A QP of the application's own on the ID's device. */
struct own {
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	char buf[8192];
};

static int own_qp(struct rdma_cm_id *id, struct own *o)
{
	struct ibv_qp_init_attr a;

	o->pd = ibv_alloc_pd(id->verbs);
	o->cq = o->pd ? ibv_create_cq(id->verbs, 16, NULL, NULL, 0) : NULL;
	memset(&a, 0, sizeof a);
	a.send_cq = a.recv_cq = o->cq;
	a.cap.max_send_wr = a.cap.max_recv_wr = 8;
	a.cap.max_send_sge = a.cap.max_recv_sge = 1;
	a.qp_type = IBV_QPT_RC;
	a.sq_sig_all = 1;
	o->qp = o->cq ? ibv_create_qp(o->pd, &a) : NULL;
	o->mr = o->qp ? ibv_reg_mr(o->pd, o->buf, sizeof o->buf,
				   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)
		      : NULL;
	return o->mr != NULL;
}

static void own_free(struct own *o)
{
	if (o->mr)
		ibv_dereg_mr(o->mr);
	if (o->qp)
		ibv_destroy_qp(o->qp);
	if (o->cq)
		ibv_destroy_cq(o->cq);
	if (o->pd)
		ibv_dealloc_pd(o->pd);
}

/* rdma_init_qp_attr for `state`, then ibv_modify_qp with its mask; returns the mask. */
static int move(struct rdma_cm_id *id, struct ibv_qp *qp, enum ibv_qp_state state, struct ibv_qp_attr *a)
{
	int mask = 0;

	memset(a, 0, sizeof *a);
	a->qp_state = state;
	CHECK(rdma_init_qp_attr(id, a, &mask) == 0, "rdma_init_qp_attr(%d)", state);
	CHECK(ibv_modify_qp(qp, a, mask) == 0, "ibv_modify_qp(%d) mask 0x%x", state, mask);
	return mask;
}

static int wait_wc(struct ibv_cq *cq, struct ibv_wc *wc)
{
	for (int i = 0; i < 10000000; i++) {
		int n = ibv_poll_cq(cq, 1, wc);
		if (n)
			return n;
	}
	return 0;
}

static enum ibv_qp_state qp_state(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr i;

	if (ibv_query_qp(qp, &a, IBV_QP_STATE, &i))
		return (enum ibv_qp_state)-1;
	return a.qp_state;
}

static void application_owned_qps(void)
{
	const int init_mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
	const int rtr_mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
			     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
	const int rts_mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
			     IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
	const int remote = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
	struct rdma_event_channel *sch = rdma_create_event_channel();
	struct rdma_event_channel *cch = rdma_create_event_channel();
	struct rdma_cm_id *listener, *client, *server = NULL;
	struct sockaddr_in s = sin_of("127.0.0.11", 7002), c = sin_of("127.0.0.12", 0);
	static struct own co, so;
	struct ibv_qp_attr a, srtr, srts, crtr, crts;
	struct rdma_conn_param param;
	struct rdma_cm_event *e;
	struct ibv_sge sge;
	struct ibv_send_wr swr, *bad;
	struct ibv_recv_wr rwr, *rbad;
	struct ibv_wc wc;
	int mask;

	CHECK(rdma_create_id(sch, &listener, NULL, RDMA_PS_TCP) == 0, "listener");
	CHECK(rdma_bind_addr(listener, (struct sockaddr *)&s) == 0, "bind");
	CHECK(rdma_listen(listener, 4) == 0, "listen");
	CHECK(rdma_create_id(cch, &client, NULL, RDMA_PS_TCP) == 0, "client");
	CHECK(rdma_resolve_addr(client, (struct sockaddr *)&c, (struct sockaddr *)&s, 2000) == 0, "resolve");
	if ((e = expect(cch, RDMA_CM_EVENT_ADDR_RESOLVED)))
		rdma_ack_cm_event(e);
	CHECK(rdma_resolve_route(client, 2000) == 0, "route");
	if ((e = expect(cch, RDMA_CM_EVENT_ROUTE_RESOLVED)))
		rdma_ack_cm_event(e);
	CHECK(own_qp(client, &co), "client's own QP");
	mask = move(client, co.qp, IBV_QPS_INIT, &a);
	CHECK(mask == init_mask && a.qp_access_flags == 0 && a.port_num == 1 && a.pkey_index == 0,
	      "INIT before connecting: mask 0x%x access 0x%x", mask, a.qp_access_flags);
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	errno = 0;
	CHECK(rdma_init_qp_attr(client, &a, &mask) == -1 && errno == EINVAL, "RTR before a connection");
	CHECK(rdma_establish(client) == -1 && errno == EINVAL, "establish before a response");
	memset(&param, 0, sizeof param);
	param.private_data = "own";
	param.private_data_len = 4;
	param.responder_resources = param.initiator_depth = 2;
	param.retry_count = 6;
	param.rnr_retry_count = 5;
	param.qp_num = co.qp->qp_num;
	CHECK(rdma_connect(client, &param) == 0, "connect");

	if ((e = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST))) {
		server = e->id;
		CHECK(e->param.conn.qp_num == co.qp->qp_num, "request qp_num");
		rdma_ack_cm_event(e);
	}
	if (!server)
		goto out;
	CHECK(server->qp == NULL, "no QP on the new ID");
	CHECK(own_qp(server, &so), "server's own QP");
	mask = move(server, so.qp, IBV_QPS_INIT, &a);
	CHECK(mask == init_mask && (int)a.qp_access_flags == remote, "INIT of a request: access 0x%x",
	      a.qp_access_flags);
	sge.addr = (uintptr_t)so.buf;
	sge.length = 4096;
	sge.lkey = so.mr->lkey;
	memset(&rwr, 0, sizeof rwr);
	rwr.wr_id = 1;
	rwr.sg_list = &sge;
	rwr.num_sge = 1;
	CHECK(ibv_post_recv(so.qp, &rwr, &rbad) == 0, "server recv");
	mask = move(server, so.qp, IBV_QPS_RTR, &srtr);
	CHECK(mask == rtr_mask, "RTR mask 0x%x", mask);
	CHECK(srtr.dest_qp_num == co.qp->qp_num && srtr.max_dest_rd_atomic == 2 && srtr.min_rnr_timer == 0 &&
	      srtr.path_mtu == client->route.path_rec->mtu, "RTR values %d %d %d %d", srtr.dest_qp_num,
	      srtr.max_dest_rd_atomic, srtr.min_rnr_timer, srtr.path_mtu);
	CHECK(srtr.ah_attr.is_global == 1 && srtr.ah_attr.port_num == 1 && srtr.ah_attr.grh.hop_limit == 64 &&
	      srtr.ah_attr.grh.sgid_index == 1 && srtr.ah_attr.grh.dgid.raw[15] == 12 &&
	      srtr.ah_attr.grh.dgid.raw[10] == 0xff, "RTR address vector");
	mask = move(server, so.qp, IBV_QPS_RTS, &srts);
	CHECK(mask == rts_mask, "RTS mask 0x%x", mask);
	CHECK(srts.timeout == 19 && srts.retry_cnt == 6 && srts.rnr_retry == 5 && srts.max_rd_atomic == 2,
	      "RTS values %d %d %d %d", srts.timeout, srts.retry_cnt, srts.rnr_retry, srts.max_rd_atomic);
	memset(&param, 0, sizeof param);
	param.private_data = "yours";
	param.private_data_len = 6;
	param.responder_resources = param.initiator_depth = 2;
	param.rnr_retry_count = 7;
	param.qp_num = so.qp->qp_num;
	CHECK(rdma_accept(server, &param) == 0, "accept");

	if ((e = expect(cch, RDMA_CM_EVENT_CONNECT_RESPONSE))) {
		CHECK(e->status == 0 && e->param.conn.qp_num == so.qp->qp_num &&
		      e->param.conn.private_data_len >= 6 && !memcmp(e->param.conn.private_data, "yours", 6),
		      "connect response");
		rdma_ack_cm_event(e);
	}
	CHECK(quiet(sch, 100), "the passive side waits for the RTU");
	mask = move(client, co.qp, IBV_QPS_INIT, &a);
	CHECK((int)a.qp_access_flags == remote, "INIT after the response: access 0x%x", a.qp_access_flags);
	move(client, co.qp, IBV_QPS_RTR, &crtr);
	move(client, co.qp, IBV_QPS_RTS, &crts);
	CHECK(crtr.dest_qp_num == so.qp->qp_num && crtr.rq_psn == srts.sq_psn && srtr.rq_psn == crts.sq_psn,
	      "the PSNs pair up");
	CHECK(crts.rnr_retry == 7, "the REP's RNR retries");
	CHECK(rdma_establish(client) == 0, "establish");
	if ((e = expect(sch, RDMA_CM_EVENT_ESTABLISHED)))
		rdma_ack_cm_event(e);
	CHECK(quiet(cch, 100), "no event on the active side after rdma_establish");

	for (int i = 0; i < 4096; i++)
		co.buf[i] = (char)(i * 7 + 1);
	sge.addr = (uintptr_t)co.buf;
	sge.length = 3000;
	sge.lkey = co.mr->lkey;
	memset(&swr, 0, sizeof swr);
	swr.wr_id = 2;
	swr.sg_list = &sge;
	swr.num_sge = 1;
	swr.opcode = IBV_WR_SEND;
	CHECK(ibv_post_send(co.qp, &swr, &bad) == 0, "send");
	CHECK(wait_wc(co.cq, &wc) == 1 && wc.status == IBV_WC_SUCCESS, "send completion %d", wc.status);
	CHECK(wait_wc(so.cq, &wc) == 1 && wc.status == IBV_WC_SUCCESS && wc.byte_len == 3000, "received");
	CHECK(!memcmp(so.buf, co.buf, 3000), "SEND bytes");
	sge.addr = (uintptr_t)co.buf + 100;
	sge.length = 2000;
	swr.wr_id = 3;
	swr.opcode = IBV_WR_RDMA_WRITE;
	swr.wr.rdma.remote_addr = (uintptr_t)so.buf + 5000;
	swr.wr.rdma.rkey = so.mr->rkey;
	CHECK(ibv_post_send(co.qp, &swr, &bad) == 0, "write");
	CHECK(wait_wc(co.cq, &wc) == 1 && wc.status == IBV_WC_SUCCESS, "write completion %d", wc.status);
	CHECK(!memcmp(so.buf + 5000, co.buf + 100, 2000), "WRITE bytes");

	CHECK(rdma_disconnect(client) == 0, "disconnect");
	if ((e = expect(cch, RDMA_CM_EVENT_DISCONNECTED)))
		rdma_ack_cm_event(e);
	if ((e = expect(sch, RDMA_CM_EVENT_DISCONNECTED)))
		rdma_ack_cm_event(e);
	CHECK(qp_state(co.qp) == IBV_QPS_RTS && qp_state(so.qp) == IBV_QPS_RTS,
	      "the CM leaves the application's QPs alone");
	CHECK(rdma_destroy_id(server) == 0, "destroy server");
out:
	own_free(&so);
	own_free(&co);
	CHECK(rdma_destroy_id(client) == 0, "destroy client");
	CHECK(rdma_destroy_id(listener) == 0, "destroy listener");
	rdma_destroy_event_channel(sch);
	rdma_destroy_event_channel(cch);
}

static void addr_errors(void)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct sockaddr_in src = sin_of("127.0.0.12", 0), dst = sin_of("198.51.100.7", 7471);
	struct rdma_cm_id *id, *sync;
	struct rdma_cm_event *e;

	CHECK(rdma_create_id(ch, &id, NULL, RDMA_PS_TCP) == 0, "id");
	CHECK(rdma_resolve_addr(id, (struct sockaddr *)&src, (struct sockaddr *)&dst, 2000) == 0, "resolve");
	if ((e = expect(ch, RDMA_CM_EVENT_ADDR_ERROR))) {
		CHECK(e->status == -EINVAL, "ADDR_ERROR status %d", e->status);
		rdma_ack_cm_event(e);
	}
	CHECK(rdma_destroy_id(id) == 0, "destroy");
	CHECK(rdma_create_id(NULL, &sync, NULL, RDMA_PS_TCP) == 0, "sync id");
	errno = 0;
	CHECK(rdma_resolve_addr(sync, (struct sockaddr *)&src, (struct sockaddr *)&dst, 2000) == -1 &&
	      errno == EINVAL, "synchronous ADDR_ERROR");
	CHECK(sync->event && sync->event->event == RDMA_CM_EVENT_ADDR_ERROR, "kept event");
	CHECK(rdma_destroy_id(sync) == 0, "destroy sync id");
	rdma_destroy_event_channel(ch);
}

static void ipv6(void)
{
	struct rdma_event_channel *sch = rdma_create_event_channel();
	struct rdma_event_channel *cch = rdma_create_event_channel();
	struct sockaddr_in6 s = sin6_of("::1", 7003);
	struct rdma_cm_id *listener, *client, *server = NULL;
	struct ibv_qp_init_attr attr;
	struct rdma_conn_param param;
	struct rdma_cm_event *e;
	char cbuf[64] = "ping over IPv6", sbuf[64];
	struct ibv_mr *cmr = NULL, *smr = NULL;
	struct sockaddr_in6 *peer, *local;
	struct ibv_wc wc;
	int ret;

	CHECK(rdma_create_id(sch, &listener, NULL, RDMA_PS_TCP) == 0, "listener");
	CHECK(rdma_bind_addr(listener, (struct sockaddr *)&s) == 0, "bind ::1");
	CHECK(rdma_listen(listener, 4) == 0, "listen");
	CHECK(rdma_create_id(cch, &client, NULL, RDMA_PS_TCP) == 0, "client");
	CHECK(rdma_resolve_addr(client, NULL, (struct sockaddr *)&s, 2000) == 0, "resolve ::1");
	if ((e = expect(cch, RDMA_CM_EVENT_ADDR_RESOLVED)))
		rdma_ack_cm_event(e);
	local = (struct sockaddr_in6 *)rdma_get_local_addr(client);
	CHECK(local->sin6_family == AF_INET6 && IN6_IS_ADDR_LOOPBACK(&local->sin6_addr), "local ::1");
	CHECK(rdma_resolve_route(client, 2000) == 0, "route");
	if ((e = expect(cch, RDMA_CM_EVENT_ROUTE_RESOLVED)))
		rdma_ack_cm_event(e);
	CHECK(client->route.path_rec && client->route.path_rec->sgid.raw[15] == 1 &&
	      client->route.path_rec->dgid.raw[15] == 1 && client->route.path_rec->dgid.raw[10] == 0,
	      "path record GIDs are ::1");
	memset(&attr, 0, sizeof attr);
	attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
	attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
	attr.qp_type = IBV_QPT_RC;
	attr.sq_sig_all = 1;
	CHECK(rdma_create_qp(client, NULL, &attr) == 0, "client QP");
	cmr = rdma_reg_msgs(client, cbuf, sizeof cbuf);
	memset(&param, 0, sizeof param);
	param.private_data = "six";
	param.private_data_len = 4;
	param.responder_resources = param.initiator_depth = 1;
	CHECK(rdma_connect(client, &param) == 0, "connect");
	if ((e = expect(sch, RDMA_CM_EVENT_CONNECT_REQUEST))) {
		server = e->id;
		peer = (struct sockaddr_in6 *)rdma_get_peer_addr(server);
		CHECK(peer->sin6_family == AF_INET6 && IN6_IS_ADDR_LOOPBACK(&peer->sin6_addr) &&
		      peer->sin6_port == local->sin6_port, "the peer's IPv6 address and port from the header");
		CHECK(!memcmp(e->param.conn.private_data, "six", 4), "private data after the header");
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
	CHECK(rdma_accept(server, NULL) == 0, "accept");
	if ((e = expect(cch, RDMA_CM_EVENT_ESTABLISHED)))
		rdma_ack_cm_event(e);
	if ((e = expect(sch, RDMA_CM_EVENT_ESTABLISHED)))
		rdma_ack_cm_event(e);
	CHECK(rdma_post_send(client, client, cbuf, sizeof cbuf, cmr, 0) == 0, "send");
	while ((ret = rdma_get_send_comp(client, &wc)) == 0)
		;
	CHECK(ret > 0 && wc.status == IBV_WC_SUCCESS, "send completion %d", wc.status);
	while ((ret = rdma_get_recv_comp(server, &wc)) == 0)
		;
	CHECK(ret > 0 && wc.status == IBV_WC_SUCCESS && !strcmp(sbuf, "ping over IPv6"), "received");
	CHECK(rdma_disconnect(server) == 0, "disconnect");
	if ((e = expect(sch, RDMA_CM_EVENT_DISCONNECTED)))
		rdma_ack_cm_event(e);
	if ((e = expect(cch, RDMA_CM_EVENT_DISCONNECTED)))
		rdma_ack_cm_event(e);
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

int main(void)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	application_owned_qps();
	addr_errors();
	ipv6();
	printf("cm_app_qp: %d checks, %d failed\n", checks, failed);
	return failed ? 1 : 0;
}
