/*
 * The C side of softrdma's libibverbs ABI: compiled against rdma-core's <infiniband/verbs.h>
 * (Debian libibverbs-dev) and linked to our libibverbs.so.1 (tests/abi.rs builds and runs it).
 *
 * 1. Struct sizes and offsets the library relies on: the same numbers crates/ffi/src/abi.rs pins
 *    with const assertions, checked here against the real header.
 * 2. The data path through the header's inline functions (ops and verbs_context dispatch): two RC
 *    QPs on one device, connected to each other; SEND, RDMA WRITE, RDMA READ, fetch-and-add, the
 *    extended CQ and the ibv_wr_* builder, completion channel events.
 * 3. Error paths: bad lkey, bad QP transition, deregistering an MR in use, destroying a CQ, PD or
 *    channel still in use, bad_wr on a failing chain (refused by the QP, or not convertible),
 *    refused extended verbs.
 *
 * Prints one line per failed check and "abi: N checks, M failed"; exits 1 on any failure.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>

static int checks, failed;

#define CHECK(cond, ...)                                                     \
	do {                                                                 \
		checks++;                                                    \
		if (!(cond)) {                                               \
			failed++;                                            \
			printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
			printf(__VA_ARGS__);                                 \
			printf("\n");                                        \
		}                                                            \
	} while (0)

#define SIZE(t, n) CHECK(sizeof(struct t) == (n), "sizeof(struct " #t ") = %zu", sizeof(struct t))
#define OFF(t, f, n) CHECK(offsetof(struct t, f) == (n), "offsetof(" #t ", " #f ") = %zu", offsetof(struct t, f))

static void layouts(void)
{
	SIZE(ibv_device, 664); OFF(ibv_device, node_type, 16); OFF(ibv_device, name, 24);
	OFF(ibv_device, dev_name, 88); OFF(ibv_device, dev_path, 152); OFF(ibv_device, ibdev_path, 408);
	SIZE(ibv_context_ops, 256); OFF(ibv_context_ops, poll_cq, 88); OFF(ibv_context_ops, req_notify_cq, 96);
	OFF(ibv_context_ops, post_srq_recv, 160); OFF(ibv_context_ops, post_send, 200); OFF(ibv_context_ops, post_recv, 208);
	SIZE(ibv_context, 328); OFF(ibv_context, ops, 8); OFF(ibv_context, cmd_fd, 264); OFF(ibv_context, async_fd, 268);
	OFF(ibv_context, num_comp_vectors, 272); OFF(ibv_context, mutex, 280); OFF(ibv_context, abi_compat, 320);
	SIZE(verbs_context, 648); OFF(verbs_context, create_cq_ex, 200); OFF(verbs_context, query_device_ex, 216);
	OFF(verbs_context, create_qp_ex, 264); OFF(verbs_context, get_srq_num, 272); OFF(verbs_context, create_srq_ex, 280);
	OFF(verbs_context, sz, 312); OFF(verbs_context, context, 320);
	SIZE(ibv_device_attr, 232); OFF(ibv_device_attr, node_guid, 64); OFF(ibv_device_attr, max_mr_size, 80);
	OFF(ibv_device_attr, vendor_id, 96); OFF(ibv_device_attr, max_qp, 108); OFF(ibv_device_attr, device_cap_flags, 116);
	OFF(ibv_device_attr, atomic_cap, 164); OFF(ibv_device_attr, max_srq_sge, 220); OFF(ibv_device_attr, max_pkeys, 224);
	OFF(ibv_device_attr, phys_port_cnt, 227);
	SIZE(ibv_device_attr_ex, 400); OFF(ibv_device_attr_ex, comp_mask, 232); OFF(ibv_device_attr_ex, odp_caps, 240);
	OFF(ibv_device_attr_ex, completion_timestamp_mask, 264); OFF(ibv_device_attr_ex, hca_core_clock, 272);
	OFF(ibv_device_attr_ex, device_cap_flags_ex, 280);
	SIZE(ibv_port_attr, 52); OFF(ibv_port_attr, gid_tbl_len, 12); OFF(ibv_port_attr, pkey_tbl_len, 32);
	OFF(ibv_port_attr, lmc, 38); OFF(ibv_port_attr, active_width, 43); OFF(ibv_port_attr, phys_state, 45);
	OFF(ibv_port_attr, link_layer, 46); OFF(ibv_port_attr, flags, 47); OFF(ibv_port_attr, port_cap_flags2, 48);
	SIZE(ibv_gid_entry, 32); OFF(ibv_gid_entry, gid_index, 16); OFF(ibv_gid_entry, gid_type, 24);
	SIZE(ibv_async_event, 16); OFF(ibv_async_event, event_type, 8);
	SIZE(ibv_wc, 48); OFF(ibv_wc, status, 8); OFF(ibv_wc, opcode, 12); OFF(ibv_wc, byte_len, 20); OFF(ibv_wc, imm_data, 24);
	OFF(ibv_wc, qp_num, 28); OFF(ibv_wc, src_qp, 32); OFF(ibv_wc, wc_flags, 36); OFF(ibv_wc, pkey_index, 40); OFF(ibv_wc, sl, 44);
	SIZE(ibv_pd, 16); SIZE(ibv_mr, 48); OFF(ibv_mr, addr, 16); OFF(ibv_mr, length, 24); OFF(ibv_mr, handle, 32);
	OFF(ibv_mr, lkey, 36); OFF(ibv_mr, rkey, 40);
	SIZE(ibv_ah_attr, 32); OFF(ibv_ah_attr, dlid, 24); OFF(ibv_ah_attr, sl, 26); OFF(ibv_ah_attr, is_global, 29);
	OFF(ibv_ah_attr, port_num, 30);
	SIZE(ibv_global_route, 24); OFF(ibv_global_route, flow_label, 16); OFF(ibv_global_route, sgid_index, 20);
	OFF(ibv_global_route, hop_limit, 21); OFF(ibv_global_route, traffic_class, 22);
	SIZE(ibv_grh, 40); OFF(ibv_grh, sgid, 8); OFF(ibv_grh, dgid, 24);
	SIZE(ibv_srq_init_attr, 24); SIZE(ibv_srq_init_attr_ex, 64); OFF(ibv_srq_init_attr_ex, comp_mask, 20);
	OFF(ibv_srq_init_attr_ex, srq_type, 24); OFF(ibv_srq_init_attr_ex, pd, 32); OFF(ibv_srq_init_attr_ex, cq, 48);
	OFF(ibv_srq_init_attr_ex, tm_cap, 56);
	SIZE(ibv_qp_init_attr, 64); OFF(ibv_qp_init_attr, cap, 32); OFF(ibv_qp_init_attr, qp_type, 52);
	OFF(ibv_qp_init_attr, sq_sig_all, 56);
	SIZE(ibv_qp_init_attr_ex, 136); OFF(ibv_qp_init_attr_ex, comp_mask, 60); OFF(ibv_qp_init_attr_ex, pd, 64);
	OFF(ibv_qp_init_attr_ex, create_flags, 80); OFF(ibv_qp_init_attr_ex, rwq_ind_tbl, 88);
	OFF(ibv_qp_init_attr_ex, rx_hash_conf, 96); OFF(ibv_qp_init_attr_ex, source_qpn, 120);
	OFF(ibv_qp_init_attr_ex, send_ops_flags, 128);
	SIZE(ibv_qp_attr, 144); OFF(ibv_qp_attr, qkey, 16); OFF(ibv_qp_attr, dest_qp_num, 28);
	OFF(ibv_qp_attr, qp_access_flags, 32); OFF(ibv_qp_attr, cap, 36); OFF(ibv_qp_attr, ah_attr, 56);
	OFF(ibv_qp_attr, alt_ah_attr, 88); OFF(ibv_qp_attr, pkey_index, 120); OFF(ibv_qp_attr, en_sqd_async_notify, 124);
	OFF(ibv_qp_attr, max_rd_atomic, 126); OFF(ibv_qp_attr, min_rnr_timer, 128); OFF(ibv_qp_attr, port_num, 129);
	OFF(ibv_qp_attr, timeout, 130); OFF(ibv_qp_attr, retry_cnt, 131); OFF(ibv_qp_attr, rnr_retry, 132);
	OFF(ibv_qp_attr, rate_limit, 136);
	SIZE(ibv_send_wr, 128); OFF(ibv_send_wr, sg_list, 16); OFF(ibv_send_wr, num_sge, 24); OFF(ibv_send_wr, opcode, 28);
	OFF(ibv_send_wr, send_flags, 32); OFF(ibv_send_wr, imm_data, 36); OFF(ibv_send_wr, wr, 40);
	OFF(ibv_send_wr, wr.atomic.swap, 56); OFF(ibv_send_wr, wr.atomic.rkey, 64); OFF(ibv_send_wr, wr.ud.remote_qpn, 48);
	OFF(ibv_send_wr, qp_type, 72); OFF(ibv_send_wr, bind_mw, 80);
	SIZE(ibv_recv_wr, 32); SIZE(ibv_sge, 16);
	SIZE(ibv_srq, 128); OFF(ibv_srq, handle, 24); OFF(ibv_srq, mutex, 32); OFF(ibv_srq, cond, 72);
	OFF(ibv_srq, events_completed, 120);
	SIZE(ibv_qp, 160); OFF(ibv_qp, handle, 48); OFF(ibv_qp, qp_num, 52); OFF(ibv_qp, state, 56); OFF(ibv_qp, qp_type, 60);
	OFF(ibv_qp, mutex, 64); OFF(ibv_qp, cond, 104); OFF(ibv_qp, events_completed, 152);
	SIZE(ibv_qp_ex, 352); OFF(ibv_qp_ex, comp_mask, 160); OFF(ibv_qp_ex, wr_id, 168); OFF(ibv_qp_ex, wr_flags, 176);
	OFF(ibv_qp_ex, wr_atomic_cmp_swp, 184); OFF(ibv_qp_ex, wr_send, 240); OFF(ibv_qp_ex, wr_set_ud_addr, 272);
	OFF(ibv_qp_ex, wr_set_sge, 304); OFF(ibv_qp_ex, wr_start, 320); OFF(ibv_qp_ex, wr_complete, 328);
	OFF(ibv_qp_ex, wr_abort, 336); OFF(ibv_qp_ex, wr_atomic_write, 344);
	SIZE(ibv_comp_channel, 16);
	SIZE(ibv_cq, 128); OFF(ibv_cq, handle, 24); OFF(ibv_cq, cqe, 28); OFF(ibv_cq, mutex, 32); OFF(ibv_cq, cond, 72);
	OFF(ibv_cq, comp_events_completed, 120);
	SIZE(ibv_cq_ex, 288); OFF(ibv_cq_ex, comp_mask, 128); OFF(ibv_cq_ex, status, 132); OFF(ibv_cq_ex, wr_id, 136);
	OFF(ibv_cq_ex, start_poll, 144); OFF(ibv_cq_ex, read_opcode, 168); OFF(ibv_cq_ex, read_wc_flags, 216);
	OFF(ibv_cq_ex, read_completion_wallclock_ns, 280);
	SIZE(ibv_cq_init_attr_ex, 56); OFF(ibv_cq_init_attr_ex, channel, 16); OFF(ibv_cq_init_attr_ex, comp_vector, 24);
	OFF(ibv_cq_init_attr_ex, wc_flags, 32); OFF(ibv_cq_init_attr_ex, comp_mask, 40); OFF(ibv_cq_init_attr_ex, flags, 44);
	OFF(ibv_cq_init_attr_ex, parent_domain, 48);
	SIZE(ibv_ah, 24);
}

/* ---- helpers ---------------------------------------------------------------------------- */

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static union ibv_gid gid;

static struct ibv_qp *make_qp(struct ibv_cq *scq, struct ibv_cq *rcq)
{
	struct ibv_qp_init_attr a = {
		.send_cq = scq, .recv_cq = rcq,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2, .max_recv_sge = 2 },
		.qp_type = IBV_QPT_RC,
	};
	return ibv_create_qp(pd, &a);
}

static int to_init(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1,
		.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
				   IBV_ACCESS_REMOTE_ATOMIC };
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

static int connect_qp(struct ibv_qp *qp, uint32_t remote_qpn)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = remote_qpn,
		.rq_psn = 0x100, .max_dest_rd_atomic = 4, .min_rnr_timer = 12 };
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.sgid_index = 1;
	a.ah_attr.grh.hop_limit = 64;
	a.ah_attr.port_num = 1;
	int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
				       IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
	if (rc)
		return rc;
	struct ibv_qp_attr r = { .qp_state = IBV_QPS_RTS, .sq_psn = 0x100, .timeout = 14, .retry_cnt = 7,
		.rnr_retry = 7, .max_rd_atomic = 4 };
	return ibv_modify_qp(qp, &r, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					     IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

/* Poll until one completion arrives (5 s at most); returns 1 with *wc filled, 0 on timeout. */
static int poll_one(struct ibv_cq *cq, struct ibv_wc *wc)
{
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		int n = ibv_poll_cq(cq, 1, wc);
		if (n < 0)
			return 0;
		if (n == 1)
			return 1;
		clock_gettime(CLOCK_MONOTONIC, &t);
		if (t.tv_sec - t0.tv_sec > 5)
			return 0;
	}
}

static int post_send(struct ibv_qp *qp, enum ibv_wr_opcode op, uint64_t wr_id, void *buf, uint32_t len,
		     uint32_t lkey, uint64_t raddr, uint32_t rkey)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = lkey };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1, .opcode = op,
		.send_flags = IBV_SEND_SIGNALED }, *bad = NULL;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

static int post_recv(struct ibv_qp *qp, uint64_t wr_id, void *buf, uint32_t len, uint32_t lkey)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = lkey };
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 }, *bad = NULL;
	return ibv_post_recv(qp, &wr, &bad);
}

/* ---- the tests ---------------------------------------------------------------------------- */

int main(void)
{
	layouts();

	int num = 0;
	struct ibv_device **list = ibv_get_device_list(&num);
	CHECK(list && num >= 1, "ibv_get_device_list: %d devices", num);
	if (!list || num < 1)
		goto out;
	CHECK(list[num] == NULL, "list not NULL-terminated");
	CHECK(strcmp(ibv_get_device_name(list[0]), "abi0") == 0, "name %s", ibv_get_device_name(list[0]));
	CHECK(ibv_get_device_guid(list[0]) != 0, "zero GUID");
	CHECK(ibv_get_device_index(list[0]) >= 0, "no index");
	ctx = ibv_open_device(list[0]);
	ibv_free_device_list(list);
	CHECK(ctx != NULL, "ibv_open_device: %s", strerror(errno));
	if (!ctx)
		goto out;
	CHECK(ctx->abi_compat == __VERBS_ABI_IS_EXTENDED, "abi_compat");
	CHECK(verbs_get_ctx(ctx) != NULL && verbs_get_ctx(ctx)->sz >= sizeof(struct verbs_context), "verbs_context");
	CHECK(ctx->async_fd >= 0 && ctx->num_comp_vectors >= 1, "async_fd %d vectors %d", ctx->async_fd,
	      ctx->num_comp_vectors);

	/* Queries. */
	struct ibv_device_attr da;
	CHECK(ibv_query_device(ctx, &da) == 0 && da.max_qp_wr == 1048576 && da.atomic_cap == IBV_ATOMIC_HCA &&
		      da.vendor_id == 0xffffff && da.phys_port_cnt == 1, "ibv_query_device");
	struct ibv_device_attr_ex dax;
	CHECK(ibv_query_device_ex(ctx, NULL, &dax) == 0 && dax.orig_attr.max_sge == 32 &&
		      dax.device_cap_flags_ex == da.device_cap_flags && dax.odp_caps.general_caps == 0,
	      "ibv_query_device_ex");
	struct ibv_query_device_ex_input in = { .comp_mask = 1 };
	CHECK(ibv_query_device_ex(ctx, &in, &dax) == EINVAL, "query_device_ex with comp_mask");
	struct ibv_port_attr pa;
	CHECK(ibv_query_port(ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE && pa.link_layer == IBV_LINK_LAYER_ETHERNET &&
		      pa.gid_tbl_len == 1024 && pa.max_msg_sz == 0x800000, "ibv_query_port");
	CHECK(ibv_query_port(ctx, 2, &pa) == EINVAL, "ibv_query_port(2)");
	CHECK(ibv_query_gid(ctx, 1, 1, &gid) == 0 && gid.raw[10] == 0xff && gid.raw[15] == 9, "GID 1 is ::ffff:127.0.0.9");
	union ibv_gid g2;
	CHECK(ibv_query_gid(ctx, 1, 5, &g2) == 0 && g2.global.interface_id == 0, "empty GID slot reads as zero");
	CHECK(ibv_query_gid(ctx, 1, 5000, &g2) == -1, "GID index past the table");
	struct ibv_gid_entry ge;
	CHECK(ibv_query_gid_ex(ctx, 1, 1, &ge, 0) == 0 && ge.gid_type == IBV_GID_TYPE_ROCE_V2, "ibv_query_gid_ex");
	CHECK(ibv_query_gid_ex(ctx, 1, 7, &ge, 0) == ENODATA, "ibv_query_gid_ex empty slot");
	__be16 pkey;
	CHECK(ibv_query_pkey(ctx, 1, 0, &pkey) == 0 && pkey == 0xffff, "ibv_query_pkey");
	CHECK(ibv_query_pkey(ctx, 1, 3, &pkey) == -1, "ibv_query_pkey bad index");
	CHECK(strcmp(ibv_wc_status_str(IBV_WC_LOC_PROT_ERR), "local protection error") == 0, "wc status string");

	/* Objects. */
	pd = ibv_alloc_pd(ctx);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	struct ibv_cq *cq_a = ibv_create_cq(ctx, 64, (void *)0x1234, ch, 0);
	struct ibv_cq *cq_b = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	CHECK(pd && ch && cq_a && cq_b, "create pd/channel/cq: %s", strerror(errno));
	if (!pd || !ch || !cq_a || !cq_b)
		goto out;
	CHECK(ibv_create_cq(ctx, 0, NULL, NULL, 0) == NULL && errno == EINVAL, "CQ of 0 entries");
	CHECK(ibv_create_cq(ctx, 16, NULL, NULL, 99) == NULL && errno == EINVAL, "bad comp_vector");
	enum { LEN = 1 << 16 };
	char *buf_a = aligned_alloc(4096, LEN), *buf_b = aligned_alloc(4096, LEN), *buf_c = aligned_alloc(4096, LEN);
	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
	struct ibv_mr *mr_a = ibv_reg_mr(pd, buf_a, LEN, acc), *mr_b = ibv_reg_mr(pd, buf_b, LEN, acc);
	struct ibv_mr *mr_c = ibv_reg_mr(pd, buf_c, LEN, acc);
	CHECK(mr_a && mr_b && mr_c && mr_a->addr == buf_a && mr_a->length == LEN && mr_a->lkey != mr_b->lkey,
	      "ibv_reg_mr: %s", strerror(errno));
	CHECK(ibv_reg_mr(pd, buf_a, LEN, IBV_ACCESS_REMOTE_WRITE) == NULL && errno == EINVAL, "REMOTE_WRITE without LOCAL_WRITE");
	CHECK(ibv_reg_mr(pd, buf_a, LEN, IBV_ACCESS_ON_DEMAND | IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EOPNOTSUPP,
	      "ODP refused");

	struct ibv_qp *qa = make_qp(cq_a, cq_a), *qb = make_qp(cq_b, cq_b);
	CHECK(qa && qb, "ibv_create_qp: %s", strerror(errno));
	if (!qa || !qb || !mr_a || !mr_b || !mr_c)
		goto out;
	CHECK(qa->state == IBV_QPS_RESET && qa->qp_num != qb->qp_num, "new QP state");

	/* Bad transition: RESET -> RTR. */
	struct ibv_qp_attr bad_attr = { .qp_state = IBV_QPS_RTR };
	CHECK(ibv_modify_qp(qa, &bad_attr, IBV_QP_STATE) == EINVAL, "RESET -> RTR must be EINVAL");
	bad_attr.qp_state = IBV_QPS_INIT;
	CHECK(ibv_modify_qp(qa, &bad_attr, IBV_QP_STATE) == EINVAL, "RESET -> INIT without attributes must be EINVAL");
	CHECK(ibv_modify_qp(qa, &bad_attr, IBV_QP_STATE | IBV_QP_ALT_PATH) == EOPNOTSUPP, "alternate path refused");

	CHECK(to_init(qa) == 0 && to_init(qb) == 0, "to INIT");
	CHECK(connect_qp(qa, qb->qp_num) == 0 && connect_qp(qb, qa->qp_num) == 0, "connect: %s", strerror(errno));
	struct ibv_qp_attr qattr;
	struct ibv_qp_init_attr qinit;
	CHECK(ibv_query_qp(qa, &qattr, IBV_QP_STATE, &qinit) == 0 && qattr.qp_state == IBV_QPS_RTS &&
		      qattr.dest_qp_num == qb->qp_num && qinit.send_cq == cq_a && qattr.path_mtu == IBV_MTU_1024,
	      "ibv_query_qp");

	/* Busy objects. */
	CHECK(ibv_destroy_cq(cq_a) == EBUSY, "destroy CQ with QPs attached must be EBUSY");
	CHECK(ibv_dealloc_pd(pd) == EBUSY, "dealloc PD with objects must be EBUSY");
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "destroy channel with CQs must be EBUSY");

	/* SEND/RECV with a channel event. */
	struct ibv_wc wc;
	strcpy(buf_a, "hello softrdma");
	CHECK(ibv_req_notify_cq(cq_a, 0) == 0, "req_notify");
	CHECK(post_recv(qb, 7, buf_b, 4096, mr_b->lkey) == 0, "post_recv");
	CHECK(post_send(qa, IBV_WR_SEND, 1, buf_a, 15, mr_a->lkey, 0, 0) == 0, "post_send SEND");
	struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
	CHECK(poll(&pfd, 1, 5000) == 1, "channel fd readable");
	struct ibv_cq *ev_cq = NULL;
	void *ev_ctx = NULL;
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq_a && ev_ctx == (void *)0x1234, "ibv_get_cq_event");
	ibv_ack_cq_events(cq_a, 1);
	CHECK(cq_a->comp_events_completed == 1, "acked");
	CHECK(poll_one(cq_a, &wc) && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_SEND && wc.wr_id == 1, "send wc");
	CHECK(poll_one(cq_b, &wc) && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && wc.byte_len == 15 &&
		      wc.wr_id == 7 && wc.qp_num == qb->qp_num, "recv wc");
	CHECK(strcmp(buf_b, "hello softrdma") == 0, "received data");
	int fl = fcntl(ch->fd, F_GETFL);
	fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK);
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == -1 && errno == EAGAIN, "non-blocking channel: EAGAIN");
	fcntl(ch->fd, F_SETFL, fl);

	/* RDMA WRITE, READ, fetch-and-add. */
	memset(buf_b, 0, LEN);
	for (int i = 0; i < 8192; i++)
		buf_a[i] = (char)i;
	CHECK(post_send(qa, IBV_WR_RDMA_WRITE, 2, buf_a, 8192, mr_a->lkey, (uintptr_t)buf_b, mr_b->rkey) == 0, "post WRITE");
	CHECK(poll_one(cq_a, &wc) && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_WRITE, "write wc %s",
	      ibv_wc_status_str(wc.status));
	CHECK(memcmp(buf_a, buf_b, 8192) == 0, "written data");
	memset(buf_a, 0, 8192);
	CHECK(post_send(qa, IBV_WR_RDMA_READ, 3, buf_a, 8192, mr_a->lkey, (uintptr_t)buf_b, mr_b->rkey) == 0, "post READ");
	CHECK(poll_one(cq_a, &wc) && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_READ, "read wc");
	CHECK(memcmp(buf_a, buf_b, 8192) == 0, "read data");
	uint64_t *counter = (uint64_t *)(buf_b + 16384);
	*counter = 40;
	struct ibv_sge asge = { .addr = (uintptr_t)buf_a, .length = 8, .lkey = mr_a->lkey };
	struct ibv_send_wr awr = { .wr_id = 4, .sg_list = &asge, .num_sge = 1, .opcode = IBV_WR_ATOMIC_FETCH_AND_ADD,
		.send_flags = IBV_SEND_SIGNALED }, *bad = NULL;
	awr.wr.atomic.remote_addr = (uintptr_t)counter;
	awr.wr.atomic.compare_add = 2;
	awr.wr.atomic.rkey = mr_b->rkey;
	CHECK(ibv_post_send(qa, &awr, &bad) == 0, "post FETCH_ADD");
	CHECK(poll_one(cq_a, &wc) && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_FETCH_ADD, "atomic wc");
	CHECK(*(uint64_t *)buf_a == 40 && *counter == 42, "fetch-and-add: got %llu, now %llu",
	      (unsigned long long)*(uint64_t *)buf_a, (unsigned long long)*counter);

	/* bad_wr: the second WR of a chain has too many SGEs; the first is posted. */
	struct ibv_sge sges[4] = { { (uintptr_t)buf_a, 8, mr_a->lkey }, { (uintptr_t)buf_a, 8, mr_a->lkey },
				   { (uintptr_t)buf_a, 8, mr_a->lkey }, { (uintptr_t)buf_a, 8, mr_a->lkey } };
	struct ibv_send_wr w2 = { .wr_id = 6, .sg_list = sges, .num_sge = 4, .opcode = IBV_WR_RDMA_WRITE,
		.send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr w1 = { .wr_id = 5, .next = &w2, .sg_list = sges, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
		.send_flags = IBV_SEND_SIGNALED };
	w1.wr.rdma.remote_addr = w2.wr.rdma.remote_addr = (uintptr_t)buf_b;
	w1.wr.rdma.rkey = w2.wr.rdma.rkey = mr_b->rkey;
	bad = NULL;
	CHECK(ibv_post_send(qa, &w1, &bad) == EINVAL && bad == &w2, "bad_wr points at the failing WR");
	CHECK(poll_one(cq_a, &wc) && wc.wr_id == 5 && wc.status == IBV_WC_SUCCESS, "the WR before it was posted");
	/* A chain whose third WR has an opcode that does not exist: the first two are posted. */
	struct ibv_send_wr w5 = w1, w4 = w1, w3 = w1;
	w3.wr_id = 61, w3.next = &w4;
	w4.wr_id = 62, w4.next = &w5;
	w5.wr_id = 63, w5.next = NULL, w5.opcode = (enum ibv_wr_opcode)0x7f;
	bad = NULL;
	CHECK(ibv_post_send(qa, &w3, &bad) == EINVAL && bad == &w5, "bad_wr points at the unconvertible WR");
	CHECK(poll_one(cq_a, &wc) && wc.wr_id == 61 && wc.status == IBV_WC_SUCCESS, "first WR of the chain");
	CHECK(poll_one(cq_a, &wc) && wc.wr_id == 62 && wc.status == IBV_WC_SUCCESS, "second WR of the chain");

	/* Bad lkey: a local protection error completion. */
	CHECK(post_send(qa, IBV_WR_RDMA_WRITE, 8, buf_a, 64, mr_a->lkey ^ 0x5a5a00, (uintptr_t)buf_b, mr_b->rkey) == 0,
	      "post with a bad lkey");
	CHECK(poll_one(cq_a, &wc) && wc.wr_id == 8 && wc.status == IBV_WC_LOC_PROT_ERR, "bad lkey: %s",
	      ibv_wc_status_str(wc.status));

	/* The QP is in ERR now; a fresh pair for the rest. */
	CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0, "destroy QPs");
	qa = make_qp(cq_a, cq_a);
	qb = make_qp(cq_b, cq_b);
	CHECK(qa && qb && to_init(qa) == 0 && to_init(qb) == 0 && connect_qp(qa, qb->qp_num) == 0 &&
		      connect_qp(qb, qa->qp_num) == 0, "second pair");

	/* Deregistering an MR that a posted receive names: allowed; the receive then fails its key
	 * check instead of writing freed memory. */
	CHECK(post_recv(qb, 9, buf_c, 4096, mr_c->lkey) == 0, "post recv into mr_c");
	CHECK(ibv_dereg_mr(mr_c) == 0, "dereg of an MR in use succeeds");
	memset(buf_c, 0x77, 64);
	CHECK(post_send(qa, IBV_WR_SEND, 10, buf_a, 64, mr_a->lkey, 0, 0) == 0, "send into the deregistered MR");
	CHECK(poll_one(cq_b, &wc) && wc.wr_id == 9 && wc.status != IBV_WC_SUCCESS, "receive into a deregistered MR: %s",
	      ibv_wc_status_str(wc.status));
	CHECK(poll_one(cq_a, &wc) && wc.wr_id == 10 && wc.status != IBV_WC_SUCCESS, "its sender sees the error: %s",
	      ibv_wc_status_str(wc.status));
	CHECK(buf_c[0] == 0x77, "deregistered memory untouched");

	/* Extended CQ and the ibv_wr_* builder on a third pair. */
	struct ibv_cq_init_attr_ex cqa = { .cqe = 32, .wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_QP_NUM };
	struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &cqa);
	CHECK(cqx != NULL, "ibv_create_cq_ex: %s", strerror(errno));
	cqa.wc_flags |= IBV_WC_EX_WITH_COMPLETION_TIMESTAMP;
	CHECK(ibv_create_cq_ex(ctx, &cqa) == NULL && errno == EOPNOTSUPP, "timestamps refused");
	struct ibv_qp_init_attr_ex xa = { .send_cq = ibv_cq_ex_to_cq(cqx), .recv_cq = ibv_cq_ex_to_cq(cqx),
		.cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1 },
		.qp_type = IBV_QPT_RC, .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = pd,
		.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_SEND };
	struct ibv_qp *qx = cqx ? ibv_create_qp_ex(ctx, &xa) : NULL;
	CHECK(qx != NULL, "ibv_create_qp_ex: %s", strerror(errno));
	CHECK(ibv_qp_to_qp_ex(qb) == NULL, "a plain QP has no qp_ex");
	struct ibv_qp_init_attr_ex xbad = xa;
	xbad.comp_mask |= IBV_QP_INIT_ATTR_XRCD;
	CHECK(ibv_create_qp_ex(ctx, &xbad) == NULL && errno == EOPNOTSUPP, "XRC refused");
	if (qx && cqx) {
		struct ibv_qp *qy = make_qp(cq_b, cq_b);
		CHECK(qy && to_init(qx) == 0 && to_init(qy) == 0 && connect_qp(qx, qy->qp_num) == 0 &&
			      connect_qp(qy, qx->qp_num) == 0, "third pair");
		struct ibv_qp_ex *x = ibv_qp_to_qp_ex(qx);
		CHECK(x != NULL, "ibv_qp_to_qp_ex");
		memset(buf_b, 0, 256);
		memset(buf_a, 0x3c, 256);
		ibv_wr_start(x);
		x->wr_id = 77;
		x->wr_flags = IBV_SEND_SIGNALED;
		ibv_wr_rdma_write(x, mr_b->rkey, (uintptr_t)buf_b);
		ibv_wr_set_sge(x, mr_a->lkey, (uintptr_t)buf_a, 256);
		CHECK(ibv_wr_complete(x) == 0, "ibv_wr_complete");
		struct ibv_poll_cq_attr pattr = {};
		int rc;
		struct timespec t0, t;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		while ((rc = ibv_start_poll(cqx, &pattr)) == ENOENT) {
			clock_gettime(CLOCK_MONOTONIC, &t);
			if (t.tv_sec - t0.tv_sec > 5)
				break;
		}
		CHECK(rc == 0 && cqx->wr_id == 77 && cqx->status == IBV_WC_SUCCESS &&
			      ibv_wc_read_opcode(cqx) == IBV_WC_RDMA_WRITE && ibv_wc_read_qp_num(cqx) == qx->qp_num,
		      "extended poll");
		if (rc == 0) {
			CHECK(ibv_next_poll(cqx) == ENOENT, "one completion only");
			ibv_end_poll(cqx);
		}
		CHECK(memcmp(buf_a, buf_b, 256) == 0, "data written through ibv_wr_*");
		ibv_wr_start(x);
		ibv_wr_local_inv(x, 1);
		CHECK(ibv_wr_complete(x) == EOPNOTSUPP, "unsupported builder op");
		CHECK(ibv_destroy_qp(qy) == 0 && ibv_destroy_qp(qx) == 0, "destroy third pair");
	}
	CHECK(cqx == NULL || ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)) == 0, "destroy cq_ex");

	/* Refused features. */
	CHECK(ibv_alloc_mw(pd, IBV_MW_TYPE_1) == NULL && errno == EOPNOTSUPP, "memory windows refused");
	CHECK(ibv_attach_mcast(qa, &gid, 0) == EINVAL, "multicast needs a UD QP and a multicast GID");
	{
		struct ibv_qp_init_attr ua = {
			.send_cq = cq_a, .recv_cq = cq_a,
			.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
			.qp_type = IBV_QPT_UD,
		};
		struct ibv_qp *ud = ibv_create_qp(pd, &ua);
		union ibv_gid mgid = { .raw = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 1, 2, 3 } };
		CHECK(ud != NULL, "UD QP");
		CHECK(ibv_attach_mcast(ud, &gid, 0) == EINVAL, "a unicast GID is no group");
		CHECK(ibv_attach_mcast(ud, &mgid, 0) == 0 && ibv_attach_mcast(ud, &mgid, 0) == 0, "attach, twice");
		CHECK(ibv_destroy_qp(ud) == EBUSY, "no destroy while attached");
		CHECK(ibv_detach_mcast(ud, &mgid, 0) == 0, "detach");
		CHECK(ibv_detach_mcast(ud, &mgid, 0) == EINVAL, "detach when not attached");
		CHECK(ibv_destroy_qp(ud) == 0, "destroy UD QP");
	}
	struct ibv_xrcd_init_attr xi = { .comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS, .fd = -1 };
	CHECK(ibv_open_xrcd(ctx, &xi) == NULL && errno == EOPNOTSUPP, "XRC domains refused");
	struct ibv_td_init_attr ti = {};
	CHECK(ibv_alloc_td(ctx, &ti) == NULL && errno == EOPNOTSUPP, "thread domains refused");
	struct ibv_modify_cq_attr mca = {};
	CHECK(ibv_modify_cq(cq_a, &mca) == EOPNOTSUPP, "CQ moderation refused");
	CHECK(ibv_resize_cq(cq_a, 128) == EOPNOTSUPP, "CQ resize refused");
	struct ibv_srq_init_attr si = { .attr = { .max_wr = 16, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &si);
	CHECK(srq != NULL, "ibv_create_srq");
	uint32_t srqn;
	CHECK(srq && ibv_get_srq_num(srq, &srqn) == EOPNOTSUPP, "SRQ numbers (XRC) refused");
	struct ibv_srq_attr sa = { .srq_limit = 4 };
	CHECK(srq && ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT) == 0, "arm SRQ limit");
	CHECK(srq && ibv_query_srq(srq, &sa) == 0 && sa.srq_limit == 4 && sa.max_wr == 16, "ibv_query_srq");
	CHECK(srq && ibv_destroy_srq(srq) == 0, "destroy SRQ");

	/* Teardown in order. */
	CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0, "destroy QPs");
	CHECK(ibv_destroy_cq(cq_a) == 0 && ibv_destroy_cq(cq_b) == 0, "destroy CQs");
	CHECK(ibv_destroy_comp_channel(ch) == 0, "destroy channel");
	CHECK(ibv_dereg_mr(mr_a) == 0 && ibv_dereg_mr(mr_b) == 0, "dereg MRs");
	CHECK(ibv_dealloc_pd(pd) == 0, "dealloc PD");
	CHECK(ibv_close_device(ctx) == 0, "close");
out:
	printf("abi: %d checks, %d failed\n", checks, failed);
	return failed ? 1 : 0;
}
