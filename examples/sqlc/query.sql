-- name: CreatePosting :one
INSERT INTO postings (account, cents, ref) VALUES ($1, $2, $3)
RETURNING id;

-- name: CountPostingsByRef :one
SELECT count(*) FROM postings WHERE ref = $1;
