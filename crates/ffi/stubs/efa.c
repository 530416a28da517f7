/*
 * libefa.so.1 for softrdma: perftest links the AWS EFA direct-verbs library even when it runs on
 * another vendor's device. softrdma devices are never EFA devices: every entry point perftest
 * imports refuses with EOPNOTSUPP (NULL and errno for pointer-returning calls).
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

struct ibv_context;
struct ibv_qp;
struct ibv_pd;
struct ibv_qp_init_attr;
struct ibv_qp_init_attr_ex;

int efadv_query_device(struct ibv_context *ibvctx, void *attr, uint32_t inlen)
{ (void)ibvctx; (void)attr; (void)inlen; return EOPNOTSUPP; }

struct ibv_qp *efadv_create_qp_ex(struct ibv_context *ibvctx, struct ibv_qp_init_attr_ex *attr_ex,
				  void *efa_attr, uint32_t inlen)
{ (void)ibvctx; (void)attr_ex; (void)efa_attr; (void)inlen; errno = EOPNOTSUPP; return NULL; }

struct ibv_qp *efadv_create_driver_qp(struct ibv_pd *ibvpd, struct ibv_qp_init_attr *attr, uint32_t driver_qp_type)
{ (void)ibvpd; (void)attr; (void)driver_qp_type; errno = EOPNOTSUPP; return NULL; }
