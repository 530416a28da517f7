/*
 * libmlx5.so.1 for softrdma: perftest links the Mellanox direct-verbs library even when it runs on
 * another vendor's device. softrdma devices are never mlx5 devices, so every entry point that
 * perftest imports says so: pointer-returning calls return NULL with errno EOPNOTSUPP, int-returning
 * calls return EOPNOTSUPP, and mlx5dv_is_supported() returns false. No ibverbs objects are touched.
 *
 * The opaque struct types are declared, never defined: nothing here looks inside them.
 */
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>

struct ibv_device;
struct ibv_context;
struct ibv_qp;
struct ibv_qp_ex;
struct ibv_qp_init_attr_ex;

#define REFUSE_PTR() do { errno = EOPNOTSUPP; return NULL; } while (0)

bool mlx5dv_is_supported(struct ibv_device *device) { (void)device; return false; }

struct ibv_context *mlx5dv_open_device(struct ibv_device *device, void *attr)
{ (void)device; (void)attr; REFUSE_PTR(); }

struct ibv_qp *mlx5dv_create_qp(struct ibv_context *context, struct ibv_qp_init_attr_ex *qp_attr, void *mlx5_qp_attr)
{ (void)context; (void)qp_attr; (void)mlx5_qp_attr; REFUSE_PTR(); }

/* Only meaningful for a QP that mlx5dv_create_qp made, which never happens here. */
void *mlx5dv_qp_ex_from_ibv_qp_ex(struct ibv_qp_ex *qp) { (void)qp; REFUSE_PTR(); }

void *mlx5dv_create_mkey(void *mkey_init_attr) { (void)mkey_init_attr; REFUSE_PTR(); }
int mlx5dv_destroy_mkey(void *mkey) { (void)mkey; return EOPNOTSUPP; }

int mlx5dv_crypto_login(struct ibv_context *context, void *login_attr)
{ (void)context; (void)login_attr; return EOPNOTSUPP; }
void *mlx5dv_dek_create(struct ibv_context *context, void *init_attr)
{ (void)context; (void)init_attr; REFUSE_PTR(); }
int mlx5dv_dek_destroy(void *dek) { (void)dek; return EOPNOTSUPP; }

int mlx5dv_devx_general_cmd(struct ibv_context *context, const void *in, size_t inlen, void *out, size_t outlen)
{ (void)context; (void)in; (void)inlen; (void)out; (void)outlen; return EOPNOTSUPP; }
