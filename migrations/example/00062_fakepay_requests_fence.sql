-- +goose Up
-- The fence of the claim a charge request was sent under (its Idemq-Fence header), NULL
-- when the request carried none: the fault suite checks that no request of a stale
-- owner reaches the provider after one of the owner that took the key over.
ALTER TABLE fakepay_requests ADD COLUMN fence bigint;

-- +goose Down
ALTER TABLE fakepay_requests DROP COLUMN fence;
